"""Data prep: CSV / Parquet / JSON lines from any fsspec URI -> train and eval Parquet shards + manifests.

Each source file is parsed by pyarrow (fast path). Only when pyarrow rejects a file, or its
label column has gaps, is the file parsed again by the precise Python pass below, which knows
the line of every record and so can name the file, line and column of each bad row (and, when
asked to, skip them). The whole data set is held in memory to split it exactly by seed.
"""
from __future__ import annotations

import collections
import csv
import dataclasses
import io
import json
import os
import posixpath
import re
from typing import Any, Iterator

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from elastic_step.data.api import MANIFEST_NAME, Field, Manifest, Shard
from elastic_step.errors import ConfigError, DataError
from elastic_step.util.atomic import atomic_directory
from elastic_step.util.storage import explain

TYPES = {"int64": pa.int64(), "float32": pa.float32(), "float64": pa.float64(),
         "string": pa.string(), "bool": pa.bool_()}
TYPE_NAMES = {t: name for name, t in TYPES.items()}
FORMATS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet", ".jsonl": "json", ".json": "json"}
MAX_BAD_ROWS = 20  # kept in the manifest; the count covers all of them
SKIP_HINT = ("Fix or delete that row, or set on_bad_rows to 'skip' (CLI: --on-bad-rows skip) to skip "
             "bad rows; skipped rows are counted in the manifest.")

# pyarrow's CSV defaults, mirrored by the precise pass. Only an empty field is missing: "NA" or
# "null" are real values in a string column (and a bad value in a numeric one).
_TRUE, _FALSE = ("1", "True", "TRUE", "true"), ("0", "False", "FALSE", "false")
_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*(e[+-]?\d+)?|\.\d+(e[+-]?\d+)?|inf|infinity|nan)", re.IGNORECASE)


@dataclasses.dataclass
class PrepResult:
    train: Manifest
    eval: Manifest
    train_uri: str  # URI of OUTPUT/train/manifest.json
    eval_uri: str   # URI of OUTPUT/eval/manifest.json


@dataclasses.dataclass
class _BadRow:
    file: str
    line: int  # 1-based as an editor shows it (CSV header = line 1); a row number for Parquet
    column: str | None
    reason: str
    unit: str = "line"

    def message(self) -> str:
        where = f", column {self.column!r}" if self.column else ""
        return f"Bad row in {self.file} {self.unit} {self.line}{where}: {self.reason}. {SKIP_HINT}"


class _BadRows:
    """Fails on the first bad row, or counts it and keeps the first few for the manifest."""

    def __init__(self, skip: bool):
        self.skip = skip
        self.count = 0
        self.first: list[dict[str, Any]] = []
        self.last: _BadRow | None = None

    def add(self, bad: _BadRow) -> None:
        if not self.skip:
            raise DataError(bad.message())
        self.count += 1
        self.last = bad
        if len(self.first) < MAX_BAD_ROWS:
            self.first.append({"file": bad.file, "line": bad.line, "column": bad.column, "reason": bad.reason})


def prepare(source: str, output: str, label: str | None = None, eval_fraction: float = 0.2,
            shard_rows: int = 50_000, schema: str | None = None, on_bad_rows: str = "fail",
            seed: int = 0, row_group_rows: int = 1024) -> PrepResult:
    """Read `source`, validate it, split it by `seed` and write OUTPUT/{train,eval}/ shards + manifest.json."""
    _check_params(source, output, label, eval_fraction, shard_rows, on_bad_rows, seed, row_group_rows)
    declared = _load_schema(schema) if schema else None
    if declared is not None and label is not None and label not in declared:
        raise DataError(f"The label column {label!r} is not in the schema {schema} (columns: "
                        f"{', '.join(declared)}). Pass a label that the schema declares, or add it there.")
    fs, files = _list_files(source)
    _check_output_outside_source(source, output, fs, files)

    bad = _BadRows(skip=on_bad_rows == "skip")
    tables = [(name, _read_file(fs, path, name, declared, label, bad)) for path, name in files]
    table = _combine(tables, declared)
    if label is not None and label not in table.column_names:
        raise DataError(f"The label column {label!r} is not in the data ({files[0][1]} has columns "
                        f"{', '.join(table.column_names)}). Pass --label with one of them.")
    if table.num_rows < 2:
        raise DataError(f"{source} has {table.num_rows} usable row(s) ({bad.count} skipped); at least 2 are "
                        "needed to split train and eval. Check the source URI and the data.")

    # An exact, seeded permutation: the same inputs and seed give the same shards, and shuffled
    # shards let workers read contiguous ranges without biasing minibatches by source order.
    n = table.num_rows
    n_eval = min(max(round(n * eval_fraction), 1), n - 1)
    perm = np.random.default_rng(seed).permutation(n)
    splits = {"train": table.take(perm[n_eval:]), "eval": table.take(perm[:n_eval])}
    fields = [Field(f.name, TYPE_NAMES[f.type]) for f in table.schema]
    manifests = {split: Manifest(split=split, shards=[], schema=fields, label=label, source=source,
                                 skipped_rows=bad.count, bad_rows=list(bad.first))
                 for split in splits}
    _write(output, splits, manifests, shard_rows, row_group_rows)
    return PrepResult(train=manifests["train"], eval=manifests["eval"],
                      train_uri=manifests["train"].uri, eval_uri=manifests["eval"].uri)


# ---------------------------------------------------------------- parameters, schema, files

def _check_params(source, output, label, eval_fraction, shard_rows, on_bad_rows, seed, row_group_rows):
    if not isinstance(source, str) or not source:
        raise ConfigError("No source given: pass the URI of a CSV, Parquet or JSON-lines file, folder or glob.")
    if not isinstance(output, str) or not output:
        raise ConfigError("No output given: pass the folder (local path or URI) to write train/ and eval/ to.")
    if label is not None and (not isinstance(label, str) or not label):
        raise ConfigError(f"label must be a column name, got {label!r}.")
    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) \
            or not 0 < eval_fraction < 1:
        raise ConfigError(f"eval_fraction must be between 0 and 1 (exclusive), got {eval_fraction!r}; "
                          "e.g. 0.2 keeps a fifth of the rows for evaluation.")
    for name, value in (("shard_rows", shard_rows), ("row_group_rows", row_group_rows)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}.")
    if on_bad_rows not in ("fail", "skip"):
        raise ConfigError(f"on_bad_rows must be 'fail' or 'skip', got {on_bad_rows!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}.")


def _load_schema(uri: str) -> dict[str, pa.DataType]:
    try:
        with fsspec.open(uri, "r") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:  # ValueError covers JSON syntax and unknown protocols
        raise ConfigError(f"Cannot read the schema file {uri}: {e}. Pass a JSON file like "
                          '{"fields": [{"name": "x", "type": "float32"}]}.') from None
    fields = raw.get("fields") if isinstance(raw, dict) else None
    if not isinstance(fields, list) or not fields:
        raise ConfigError(f"The schema file {uri} needs a non-empty \"fields\" list of "
                          '{"name": ..., "type": ...} objects.')
    declared: dict[str, pa.DataType] = {}
    for f in fields:
        name, type_ = (f.get("name"), f.get("type")) if isinstance(f, dict) else (None, None)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"The schema file {uri} has a field without a name: {f!r}.")
        if type_ not in TYPES:
            raise ConfigError(f"Column {name!r} in the schema file {uri} has type {type_!r}; "
                              f"use one of {', '.join(TYPES)}.")
        if name in declared:
            raise ConfigError(f"Column {name!r} appears twice in the schema file {uri}.")
        declared[name] = TYPES[type_]
    return declared


def _list_files(source: str) -> tuple[fsspec.AbstractFileSystem, list[tuple[str, str]]]:
    """(filesystem, [(path, name to show the user)]) of the data files `source` names, in a stable order."""
    try:
        fs, path = fsspec.core.url_to_fs(source)
        if any(c in path for c in "*?["):
            paths = sorted(p for p in fs.glob(path) if fs.isfile(p))
        elif fs.isdir(path):
            base = path.rstrip("/")
            # Hidden and underscore names (.tmp folders, _SUCCESS markers) are not data.
            paths = sorted(p for p in fs.find(path) if not any(
                part.startswith((".", "_")) for part in posixpath.relpath(p, base).split("/")))
        elif fs.isfile(path):
            paths = [path]
        else:
            raise DataError(f"Nothing exists at the source {source}. Check the path or URI (a file, "
                            "a folder or a glob of CSV, Parquet or JSON-lines files).")
    except DataError:
        raise
    except Exception as e:  # missing fsspec plugin (gcsfs/s3fs), credentials, permissions, bad URI
        raise DataError(explain(source, e, "read the source")) from None
    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    named = [(p, p if local else fs.unstrip_protocol(p)) for p in paths]
    unknown = [name for p, name in named if _format(p) is None]
    named = [(p, name) for p, name in named if _format(p) is not None]
    if not named:
        raise DataError(f"No data files at {source}" + (f" (found {', '.join(unknown[:5])})" if unknown else "")
                        + f". Data files must end in {', '.join(FORMATS)}; rename them or point at others.")
    return fs, named


def _format(path: str) -> str | None:
    return FORMATS.get(posixpath.splitext(path)[1].lower())


def _local(uri: str) -> str | None:
    if uri.startswith("file://"):
        return uri[len("file://"):]
    return None if "://" in uri else uri


def _check_output_outside_source(source: str, output: str, fs, files) -> None:
    # An output inside a source folder would be read back as input by the next run.
    try:
        out_fs, out_path = fsspec.core.url_to_fs(output)
    except Exception as e:
        raise ConfigError(f"Cannot use the output {output}: {type(e).__name__}: {e}.") from None
    if type(out_fs) is not type(fs):
        return
    out = out_fs._strip_protocol(out_path).rstrip("/") + "/"
    src = fs._strip_protocol(fsspec.core.url_to_fs(source)[1]).rstrip("/") + "/"
    if out.startswith(src) or any(fs._strip_protocol(p).startswith(out) for p, _ in files):
        raise ConfigError(f"The output {output} is inside the source {source}; write it elsewhere so "
                          "that prepared shards are not read back as input.")


# ---------------------------------------------------------------- reading one file

def _read_file(fs, path: str, name: str, declared, label, bad: _BadRows) -> pa.Table:
    fmt = _format(path)
    try:
        if fmt == "parquet":
            return _read_parquet(fs, path, name, declared, label, bad)
        if fmt == "csv":
            return _read_csv(fs, path, name, declared, label, bad)
        return _read_json(fs, path, name, declared, label, bad)
    except OSError as e:
        raise DataError(f"Cannot read {name}: {e}. Check that it exists and the step may read it.") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{name} is not UTF-8 text ({e}). Re-encode it as UTF-8.") from None


def _read_parquet(fs, path, name, declared, label, bad) -> pa.Table:
    try:
        with fs.open(path, "rb") as f:
            table = pq.read_table(f)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise DataError(f"{name} is not a readable Parquet file: {e}. Re-export it, or give it the "
                        "extension of its real format.") from None
    table = _supported(table, name)
    if declared is not None:
        _check_columns(table.column_names, declared, name)
        table = pa.table({c: _cast_declared(table.column(c), t, c, name) for c, t in declared.items()})
    if label is not None and label in table.column_names and table.column(label).null_count:
        # Parquet has no lines: report 1-based row numbers.
        missing = np.flatnonzero(table.column(label).is_null().to_numpy(zero_copy_only=False))
        for i in missing:
            bad.add(_BadRow(name, int(i) + 1, label, "the label is missing", unit="row"))
        table = table.filter(table.column(label).is_valid())
        _check_not_all_bad(table, name, bad)
    return table


def _read_csv(fs, path, name, declared, label, bad) -> pa.Table:
    header = _csv_header(fs, path, name)
    if declared is not None:
        _check_columns(header, declared, name)
    types = dict(declared) if declared is not None else None
    try:
        table = _arrow_csv(fs, path, types or {})
        if types is None:
            # pyarrow infers ISO dates as timestamps; keep the text as written instead.
            temporal = {f.name: pa.string() for f in table.schema if pa.types.is_temporal(f.type)}
            if temporal:
                table = _arrow_csv(fs, path, temporal)
        table = _supported(table, name)
        if label is None or label not in table.column_names or not table.column(label).null_count:
            return table
        types = {f.name: f.type for f in table.schema}
    except pa.ArrowInvalid:
        pass  # a bad row; the precise pass finds it
    return _precise(_csv_records(fs, path, name, header), header, types, label, name, bad, text=True)


def _arrow_csv(fs, path, column_types) -> pa.Table:
    with fs.open(path, "rb") as f:
        return pa_csv.read_csv(
            f, parse_options=pa_csv.ParseOptions(newlines_in_values=True),
            convert_options=pa_csv.ConvertOptions(column_types=column_types, null_values=[""],
                                                  strings_can_be_null=True, true_values=list(_TRUE),
                                                  false_values=list(_FALSE)))


def _open_text(fs, path):
    # utf-8-sig drops a byte-order mark, as pyarrow does, so both passes see the same header.
    return io.TextIOWrapper(fs.open(path, "rb"), encoding="utf-8-sig", newline="")


def _csv_header(fs, path, name) -> list[str]:
    with _open_text(fs, path) as f:
        header = next((row for row in csv.reader(f) if row), None)
    if header is None:
        raise DataError(f"{name} is empty; a CSV file needs a header line naming its columns.")
    dupes = sorted({c for c in header if header.count(c) > 1})
    if dupes or "" in header:
        what = f"repeats column(s) {', '.join(map(repr, dupes))}" if dupes else "has an unnamed column"
        raise DataError(f"The header of {name} {what}; give every column a unique name.")
    return header


def _csv_records(fs, path, name, header) -> Iterator[tuple[int, Any]]:
    """(first line of the record, {column: text} or a _BadRow), header skipped."""
    with _open_text(fs, path) as f:
        reader = csv.reader(f)
        rows = iter(reader)
        seen_header, last = False, 0
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except csv.Error as e:  # e.g. a field over the csv module's size limit
                raise DataError(f"Cannot parse {name} at line {reader.line_num}: {e}.") from None
            line, last = last + 1, reader.line_num  # a quoted field may span lines: report the first
            if not row:  # blank line, as pyarrow skips it
                continue
            if not seen_header:
                seen_header = True
                continue
            if len(row) != len(header):
                column = header[len(row)] if len(row) < len(header) else None
                yield line, _BadRow(name, line, column,
                                    f"it has {len(row)} fields but the header has {len(header)}")
                continue
            yield line, dict(zip(header, row))


def _read_json(fs, path, name, declared, label, bad) -> pa.Table:
    types = dict(declared) if declared is not None else None
    try:
        explicit = pa.schema(list(declared.items())) if declared is not None else None
        table = _arrow_json(fs, path, explicit, "error" if declared is not None else "infer")
        if types is None:
            temporal = [(f.name, pa.string()) for f in table.schema if pa.types.is_temporal(f.type)]
            if temporal:  # keep dates as written, as for CSV
                table = _arrow_json(fs, path, pa.schema(temporal), "infer")
        else:
            _check_json_columns(table, declared, name)
        table = _supported(table, name)
        if label is None or label not in table.column_names or not table.column(label).null_count:
            return table
        types = {f.name: f.type for f in table.schema}
    except pa.ArrowInvalid:
        pass  # a bad row; the precise pass finds it
    columns = list(types) if types is not None else None
    return _precise(_json_records(fs, path, name), columns, types, label, name, bad, text=False,
                    declared=declared is not None)


def _arrow_json(fs, path, explicit, unexpected) -> pa.Table:
    with fs.open(path, "rb") as f:
        return pa_json.read_json(f, parse_options=pa_json.ParseOptions(
            explicit_schema=explicit, unexpected_field_behavior=unexpected))


def _json_records(fs, path, name) -> Iterator[tuple[int, Any]]:
    with _open_text(fs, path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                yield line, _BadRow(name, line, None, f"it is not valid JSON ({e.msg})")
                continue
            if not isinstance(record, dict):
                yield line, _BadRow(name, line, None, "it is not a JSON object")
                continue
            yield line, record


def _check_json_columns(table: pa.Table, declared, name) -> None:
    # JSON rows may omit keys, so a declared column never set in the whole file is the "missing column".
    if table.num_rows:
        for c in declared:
            if table.column(c).null_count == table.num_rows:
                raise DataError(f"Column {c!r} of the schema has no value in {name}. Fix the schema "
                                "or the data so that they name the same columns.")


# ---------------------------------------------------------------- the precise pass

def _precise(records, columns, types, label, name, bad: _BadRows, text: bool, declared=False) -> pa.Table:
    """Parse `records` (from _csv_records / _json_records) value by value, naming each bad row."""
    if types is None:  # inferring types needs every value first; otherwise stream, failing early
        records = list(records)
        if columns is None:  # JSON: every key, in order of first appearance
            columns = list(dict.fromkeys(k for _, r in records if isinstance(r, dict) for k in r))
        types = _infer(columns, [r for _, r in records if isinstance(r, dict)], text, name)
    convert = _from_text if text else _from_json
    values: dict[str, list] = {c: [] for c in columns}
    for line, record in records:
        if isinstance(record, _BadRow):
            bad.add(record)
            continue
        extra = [k for k in record if k not in types]
        if extra:  # only with a declared schema: an undeclared key is a schema mismatch, not a bad row
            raise DataError(f"{name} line {line} has column {extra[0]!r}, which the schema does not "
                            "declare. Add it to the schema or remove it from the data.")
        row, problem = {}, None
        for c in columns:
            raw = record.get(c)
            try:
                row[c] = None if raw is None else convert(raw, types[c])
            except ValueError as e:
                problem = _BadRow(name, line, c, str(e))
                break
            if row[c] is None and c == label:
                problem = _BadRow(name, line, c, "the label is missing")
                break
        if problem:
            bad.add(problem)
            continue
        for c in columns:
            values[c].append(row[c])
    table = pa.table({c: pa.array(values[c], type=types[c]) for c in columns})
    if declared:
        _check_json_columns(table, types, name)
    _check_not_all_bad(table, name, bad)
    return table


def _from_text(s: str, t: pa.DataType):
    if s == "":
        return None
    if t == pa.string():
        return s
    if t == pa.int64() and _INT.fullmatch(s) and -2**63 <= int(s) < 2**63:
        return int(s)
    if pa.types.is_floating(t) and _FLOAT.fullmatch(s):
        return float(s)
    if t == pa.bool_() and s in _TRUE + _FALSE:
        return s in _TRUE
    raise ValueError(f"cannot read {s!r} as {TYPE_NAMES[t]}")


def _from_json(v, t: pa.DataType):
    # As strict as pyarrow with a declared schema: no numbers in quotes, no strings from numbers.
    if t == pa.string():
        ok = isinstance(v, str)
    elif t == pa.bool_():
        ok = isinstance(v, bool)
    elif t == pa.int64():
        ok = isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63
    else:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if not ok:
        raise ValueError(f"cannot read {json.dumps(v)[:60]} as {TYPE_NAMES.get(t, t)}")
    return v


def _infer(columns, records: list[dict], text: bool, name: str) -> dict[str, pa.DataType]:
    types = {}
    for c in columns:
        vals = [r.get(c) for r in records]
        vals = [v for v in vals if v is not None and v != ""] if text else [v for v in vals if v is not None]
        if text:  # pyarrow's CSV order: the first type every value fits
            types[c] = next((t for t in (pa.int64(), pa.bool_(), pa.float64())
                             if all(_fits(v, t) for v in vals)), pa.string()) if vals else pa.null()
            continue
        if any(isinstance(v, (dict, list)) for v in vals):
            raise DataError(f"Column {c!r} of {name} holds nested JSON values; elastic-step reads flat "
                            "records of numbers, strings and booleans. Flatten the data first.")
        # pyarrow gives up on a column mixing kinds; the majority kind wins here, so that
        # the odd values become bad rows that name their line.
        kinds = collections.Counter("bool" if isinstance(v, bool) else "str" if isinstance(v, str)
                                    else "int" if isinstance(v, int) else "float" for v in vals)
        numbers = kinds["int"] + kinds["float"]
        if not vals:
            types[c] = pa.null()
        elif numbers >= max(kinds["bool"], kinds["str"]):
            types[c] = pa.float64() if kinds["float"] else pa.int64()
        else:
            types[c] = pa.bool_() if kinds["bool"] > kinds["str"] else pa.string()
    return types


def _fits(s: str, t: pa.DataType) -> bool:
    try:
        _from_text(s, t)
        return True
    except ValueError:
        return False


def _check_not_all_bad(table: pa.Table, name: str, bad: _BadRows) -> None:
    # Skipping every row hides a wrong file or schema behind an empty data set.
    if table.num_rows == 0 and bad.last is not None and bad.last.file == name:
        raise DataError(f"Every row of {name} is bad, e.g. {bad.last.unit} {bad.last.line}: "
                        f"{bad.last.reason}. Check that the file matches the schema.")


# ---------------------------------------------------------------- types and columns

def _supported(table: pa.Table, name: str) -> pa.Table:
    """Narrow arrow's many types to the five a manifest holds, or say which column cannot be."""
    cols = {}
    for f in table.schema:
        t = f.type
        if pa.types.is_integer(t):
            target = pa.int64()
        elif pa.types.is_floating(t):
            target = pa.float64() if t == pa.float64() else pa.float32()
        elif pa.types.is_boolean(t) or pa.types.is_null(t):
            target = t
        elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_temporal(t) or (
                pa.types.is_dictionary(t) and pa.types.is_string(t.value_type)):
            target = pa.string()
        else:
            raise DataError(f"Column {f.name!r} of {name} has type {t}, which elastic-step cannot train "
                            f"on; convert it to one of {', '.join(TYPES)} (or drop it) first.")
        try:
            cols[f.name] = table.column(f.name).cast(target)
        except pa.ArrowInvalid as e:
            raise DataError(f"Column {f.name!r} of {name} does not fit {target}: {e}.") from None
    return pa.table(cols)


def _cast_declared(column: pa.ChunkedArray, declared: pa.DataType, c: str, name: str) -> pa.ChunkedArray:
    actual = column.type
    numeric = (pa.int64(), pa.float32(), pa.float64())
    if actual == declared or pa.types.is_null(actual) or (
            pa.types.is_floating(declared) and actual in numeric):
        return column.cast(declared)
    raise DataError(f"Column {c!r} of {name} holds {TYPE_NAMES.get(actual, actual)} values but the schema "
                    f"declares {TYPE_NAMES[declared]}. Fix the schema or convert the column.")


def _check_columns(columns: list[str], declared: dict, name: str) -> None:
    missing = [c for c in declared if c not in columns]
    extra = [c for c in columns if c not in declared]
    if missing:
        raise DataError(f"Column {missing[0]!r} of the schema is missing from {name}. Fix the schema or "
                        "the data so that they name the same columns.")
    if extra:
        raise DataError(f"{name} has column {extra[0]!r}, which the schema does not declare. Add it to "
                        "the schema or remove it from the data.")


def _combine(tables: list[tuple[str, pa.Table]], declared) -> pa.Table:
    """One table from all files: the same columns everywhere, types widened int -> float only."""
    first_name, first = tables[0]
    columns = list(declared) if declared is not None else first.column_names
    types = {c: first.schema.field(c).type for c in columns} if declared is None else dict(declared)
    for name, t in tables:
        if set(t.column_names) != set(columns):
            odd = sorted(set(t.column_names) ^ set(columns))[0]
            has, lacks = (name, first_name) if odd in t.column_names else (first_name, name)
            raise DataError(f"{has} has column {odd!r} but {lacks} does not; all source files need the "
                            "same columns (or pass --schema to check them).")
        if declared is None:
            for c in columns:
                types[c] = _widen(types[c], t.schema.field(c).type, c, first_name, name)
    for c, t in types.items():
        if pa.types.is_null(t):  # never had a value anywhere
            types[c] = pa.string()
    return pa.concat_tables(
        [pa.table({c: t.column(c).cast(types[c]) for c in columns}) for _, t in tables]).combine_chunks()


def _widen(a: pa.DataType, b: pa.DataType, c: str, name_a: str, name_b: str) -> pa.DataType:
    if a == b or pa.types.is_null(b):
        return a
    if pa.types.is_null(a):
        return b
    numeric = (pa.int64(), pa.float32(), pa.float64())
    if a in numeric and b in numeric:
        return pa.float64()
    raise DataError(f"Column {c!r} is {TYPE_NAMES[a]} in {name_a} but {TYPE_NAMES[b]} in {name_b}. "
                    "Pass --schema to declare its type.")


# ---------------------------------------------------------------- writing

def _write(output: str, splits: dict[str, pa.Table], manifests: dict[str, Manifest],
           shard_rows: int, row_group_rows: int) -> None:
    local = _local(output)
    if local is not None:
        if "://" not in output:  # keep the manifests' URIs valid whatever the reader's cwd
            output = os.path.abspath(output)
        _check_replaceable(local, output)
        # Everything goes to a temporary sibling folder renamed into place at the end, so a
        # failure leaves either no output or the previous one intact.
        with atomic_directory(local) as tmp:
            for split, table in splits.items():
                _write_split(fsspec.filesystem("file"), os.path.join(tmp, split), table, manifests[split],
                             shard_rows, row_group_rows, os.path.join(tmp, split, MANIFEST_NAME))
        for split, m in manifests.items():
            m.uri = posixpath.join(output.rstrip("/"), split, MANIFEST_NAME)
        return
    # Object stores cannot rename a folder. Remove the old manifests first, so that until the new
    # ones are written (last) no manifest points at half-written shards.
    fs, root = fsspec.core.url_to_fs(output)
    for split in splits:
        old = posixpath.join(root, split, MANIFEST_NAME)
        if fs.exists(old):
            fs.rm(old)
    for split, table in splits.items():
        folder = posixpath.join(root, split)
        uri = posixpath.join(output.rstrip("/"), split, MANIFEST_NAME)
        _write_split(fs, folder, table, manifests[split], shard_rows, row_group_rows, uri)
        keep = {s.path for s in manifests[split].shards} | {MANIFEST_NAME}
        for p in fs.ls(folder, detail=False):  # shards of an earlier, larger run
            if posixpath.basename(p) not in keep:
                fs.rm(p)


def _write_split(fs, folder: str, table: pa.Table, manifest: Manifest, shard_rows: int,
                 row_group_rows: int, manifest_uri: str) -> None:
    fs.makedirs(folder, exist_ok=True)
    for i, start in enumerate(range(0, table.num_rows, shard_rows)):
        part = table.slice(start, shard_rows)
        path = f"part-{i:05d}.parquet"
        with fs.open(posixpath.join(folder, path), "wb") as f:
            # Small row groups let a worker read just the groups its task's range spans.
            pq.write_table(part, f, row_group_size=row_group_rows)
        manifest.shards.append(Shard(path=path, rows=part.num_rows))
    manifest.save(manifest_uri)


def _check_replaceable(path: str, output: str) -> None:
    # The output folder is replaced as a whole: never do that to a folder holding anything else.
    if os.path.isfile(path):
        raise ConfigError(f"The output {output} is a file; pass a folder to write train/ and eval/ to.")
    if os.path.isdir(path):
        others = sorted(set(os.listdir(path)) - {"train", "eval"})
        if others:
            raise ConfigError(f"The output folder {output} already holds {', '.join(others[:3])}; data prep "
                              "replaces its output folder as a whole, so pass a new or empty folder.")
