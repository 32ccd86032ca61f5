"""Data prep: CSV / Parquet / JSON lines from any fsspec URI -> train and eval Parquet shards + manifests.

Streams: memory stays bounded (a few hundred MB) whatever the source's size. Each file is parsed
and validated a block at a time (parse.py), its rows spilled to local temporary files in buckets
by a seeded key, and the buckets read back in key order (shuffle.py): an exact shuffle by seed, of
which the first rows go to eval and the rest to train, written shard by shard (here). The spill
files take about the data's size in Arrow form on local disk, in TMPDIR.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import json
import os
import posixpath
import tempfile
from collections.abc import Iterator

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elastic_step.data import shuffle
from elastic_step.data.column_stats import ColumnStatistics
from elastic_step.data.manifest import MANIFEST_NAME, Field, Manifest, Shard
from elastic_step.data.parse import (
    FORMATS,
    MAX_BAD_ROWS,
    MAX_NON_FINITE_ROWS,
    NON_FINITE,
    NON_FINITE_HINT,
    TYPE_NAMES,
    TYPES,
    combine,
    file_format,
    record_lines,
)
from elastic_step.data.tables import compact
from elastic_step.errors import ConfigError, DataError
from elastic_step.util.atomic import atomic_directory
from elastic_step.util.storage import check_writable, explain, on_disk
from elastic_step.util.uri import local_path

__all__ = ["MAX_BAD_ROWS", "PrepResult", "prepare"]

# A shard is written in one piece while its row groups fit in this; a bigger one streams to its file.
SHARD_BUFFER_BYTES = 16 << 20
# Shards are encoded by this many threads (pyarrow releases the GIL) while pass 2 sorts the next rows.
MAX_WRITER_THREADS = 4
DICTIONARY_SAMPLE_ROWS = 4096
SPLITS = ("eval", "train")  # in the order the key sort fills them
MAX_DISTINCT_LABELS = 1000  # an integer label's distinct values are counted up to this many


@dataclasses.dataclass
class PrepResult:
    train: Manifest
    eval: Manifest
    train_uri: str  # URI of OUTPUT/train/manifest.json
    eval_uri: str  # URI of OUTPUT/eval/manifest.json


def prepare(
    source: str,
    output: str,
    label: str | None = None,
    eval_fraction: float = 0.2,
    shard_rows: int = 50_000,
    schema: str | None = None,
    on_bad_rows: str = "fail",
    seed: int = 0,
    row_group_rows: int = 1024,
    weight_column: str | None = None,
    non_finite: str = "fail",
) -> PrepResult:
    """Read `source`, validate it, split it by `seed` and write OUTPUT/{train,eval}/ shards + manifest.json.

    A CSV file is parsed on all CPUs. With 4 CPUs or more, a source of several files (32 MB or more)
    is also parsed by a process per file, one for every two CPUs (forkserver): as for any such pool,
    a script that calls prepare() needs `if __name__ == "__main__":`.

    NaN, infinite and empty cells of numeric and bool columns are refused (`non_finite` "fail", with a
    report of each column's), or their rows dropped ("drop"), or the cells set to 0 ("zero")."""
    _check_params(source, output, label, eval_fraction, shard_rows, on_bad_rows, seed, row_group_rows, non_finite)
    declared = _checked_schema(schema, label, weight_column)
    fs, files, sizes = _list_files(source)
    output = _checked_output(source, output, fs, files)

    sized = [(path, sizes[path]) for path, _ in files]
    bits, unit = shuffle.bucket_bits(sized), shuffle.unit_bytes(sized)
    with tempfile.TemporaryDirectory(prefix="elastic-step-prep-") as spill_dir:
        spilled = shuffle.spill(
            fs,
            files,
            declared,
            label,
            on_bad_rows == "skip",
            non_finite,
            seed,
            spill_dir,
            bits,
            unit,
            shuffle.processes_for(sized, fs),
        )
        data_schema = combine([(s.name, s.schema) for s in spilled], declared)
        found = _checked_rows(source, fs, files, spilled, data_schema, label, weight_column, non_finite)
        n = sum(s.rows for s in spilled)

        # An exact, seeded shuffle: the same inputs and seed give the same shards, and shuffled
        # shards let workers read contiguous ranges without biasing minibatches by source order.
        # The rows with the smallest keys are the eval split.
        n_eval = min(max(round(n * eval_fraction), 1), n - 1)
        manifests = _empty_manifests(source, spilled, data_schema, label, weight_column, non_finite, found)
        rows = shuffle.in_key_order(
            spill_dir, bits, np.sum([s.bucket_bytes for s in spilled], axis=0), data_schema, unit
        )
        _write(
            output,
            manifests,
            lambda fs, folders: _write_splits(fs, folders, rows, n_eval, manifests, shard_rows, row_group_rows),
        )
    return PrepResult(
        train=manifests["train"],
        eval=manifests["eval"],
        train_uri=manifests["train"].uri,
        eval_uri=manifests["eval"].uri,
    )


def _checked_schema(schema: str | None, label: str | None, weight_column: str | None) -> dict[str, pa.DataType] | None:
    """The declared schema, if any, checked against the label and the weight column named."""
    if weight_column is not None and (not isinstance(weight_column, str) or not weight_column):
        raise ConfigError(f"weight_column must be a column name, got {weight_column!r}.")
    if weight_column is not None and weight_column == label:
        raise ConfigError(f"The weight column {weight_column!r} is the label: name the column of sample weights.")
    declared = _load_schema(schema) if schema else None
    if declared is not None and label is not None and label not in declared:
        raise DataError(
            f"The label column {label!r} is not in the schema {schema} (columns: "
            f"{', '.join(declared)}). Pass a label that the schema declares, or add it there."
        )
    return declared


def _checked_output(source: str, output: str, fs, files) -> str:
    """Where the prepared data goes, checked before the source is read (it may take a while): outside the
    source, and replaceable or writable. A local path comes back absolute, so the manifests' URIs hold whatever
    the reader's working directory."""
    _check_output_outside_source(source, output, fs, files)
    local = local_path(output)
    if local is not None:
        if "://" not in output:
            output = os.path.abspath(output)
        _check_replaceable(local, output)
    else:
        check_writable(output, "write the prepared data to", DataError)
    return output


def _checked_rows(source: str, fs, files, spilled, data_schema, label, weight_column, non_finite: str) -> dict:
    """The rows read, checked: the label and the weight column are in the data, non-finite cells are refused
    (`non_finite` "fail") and at least 2 rows are left to split. Returns the non-finite cells found, by column."""
    skipped = sum(s.skipped for s in spilled)
    if label is not None and label not in data_schema.names:
        raise DataError(
            f"The label column {label!r} is not in the data ({files[0][1]} has columns "
            f"{', '.join(data_schema.names)}). Pass --label with one of them, or --label '' for data without one."
        )
    _check_weight_column(weight_column, data_schema, files[0][1])
    found = _non_finite_report(fs, files, spilled)
    if found and non_finite == "fail":
        raise DataError(_non_finite_message(found) + " " + NON_FINITE_HINT)
    n = sum(s.rows for s in spilled)
    if n < 2:
        raise DataError(
            f"{source} has {n} usable row(s) ({skipped} skipped); at least 2 are "
            "needed to split train and eval. Check the source URI and the data."
        )
    return found


def _empty_manifests(source: str, spilled, data_schema, label, weight_column, non_finite: str, found: dict) -> dict:
    """Each split's manifest before its shards are written: the schema, and the account of the rows skipped."""
    fields = [Field(f.name, TYPE_NAMES[f.type]) for f in data_schema]
    bad_rows = [b for s in spilled for b in s.bad_rows][:MAX_BAD_ROWS]
    return {
        split: Manifest(
            split=split,
            shards=[],
            schema=fields,
            label=label,
            weight_column=weight_column,
            source=source,
            skipped_rows=sum(s.skipped for s in spilled),
            bad_rows=list(bad_rows),
            non_finite={"policy": non_finite, "rows": sum(s.non_finite.rows for s in spilled), "columns": found}
            if found
            else {},
        )
        for split in SPLITS
    }


# ---------------------------------------------------------------- parameters, schema, files


def _check_weight_column(weight_column: str | None, data_schema: pa.Schema, first_file: str) -> None:
    """The column of sample weights (recorded in the manifest; training weighs each record's loss by it)."""
    if weight_column is None:
        return
    if weight_column not in data_schema.names:
        raise DataError(
            f"The weight column {weight_column!r} is not in the data ({first_file} has columns "
            f"{', '.join(data_schema.names)}). Pass --weight-column with one of them, or leave it out."
        )
    kind = data_schema.field(weight_column).type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise DataError(
            f"The weight column {weight_column!r} holds {TYPE_NAMES.get(kind, kind)} values: sample weights are "
            "numbers. Name a numeric column, or declare its type in --schema."
        )


def _check_params(source, output, label, eval_fraction, shard_rows, on_bad_rows, seed, row_group_rows, non_finite):
    if not isinstance(source, str) or not source:
        raise ConfigError("No source given: pass the URI of a CSV, Parquet or JSON-lines file, folder or glob.")
    if not isinstance(output, str) or not output:
        raise ConfigError("No output given: pass the folder (local path or URI) to write train/ and eval/ to.")
    if label is not None and (not isinstance(label, str) or not label):
        raise ConfigError(f"label must be a column name, got {label!r}.")
    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) or not 0 < eval_fraction < 1:
        raise ConfigError(
            f"eval_fraction must be between 0 and 1 (exclusive), got {eval_fraction!r}; "
            "e.g. 0.2 keeps a fifth of the rows for evaluation."
        )
    for name, value in (("shard_rows", shard_rows), ("row_group_rows", row_group_rows)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}.")
    if on_bad_rows not in ("fail", "skip"):
        raise ConfigError(f"on_bad_rows must be 'fail' or 'skip', got {on_bad_rows!r}.")
    if non_finite not in NON_FINITE:
        raise ConfigError(f"non_finite must be one of {', '.join(map(repr, NON_FINITE))}, got {non_finite!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}.")


def _load_schema(uri: str) -> dict[str, pa.DataType]:
    try:
        with fsspec.open(uri, "r") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:  # ValueError covers JSON syntax and unknown protocols
        raise ConfigError(
            f"Cannot read the schema file {uri}: {e}. Pass a JSON file like "
            '{"fields": [{"name": "x", "type": "float32"}]}.'
        ) from None
    fields = raw.get("fields") if isinstance(raw, dict) else None
    if not isinstance(fields, list) or not fields:
        raise ConfigError(
            f'The schema file {uri} needs a non-empty "fields" list of {{"name": ..., "type": ...}} objects.'
        )
    declared: dict[str, pa.DataType] = {}
    for f in fields:
        name, type_ = (f.get("name"), f.get("type")) if isinstance(f, dict) else (None, None)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"The schema file {uri} has a field without a name: {f!r}.")
        if type_ not in TYPES:
            raise ConfigError(
                f"Column {name!r} in the schema file {uri} has type {type_!r}; use one of {', '.join(TYPES)}."
            )
        if name in declared:
            raise ConfigError(f"Column {name!r} appears twice in the schema file {uri}.")
        declared[name] = TYPES[type_]
    return declared


def _list_files(source: str) -> tuple[fsspec.AbstractFileSystem, list[tuple[str, str]], dict[str, int]]:
    """(filesystem, [(path, name to show the user)], {path: size}) of the data files `source` names,
    in a stable order."""
    try:
        fs, path = fsspec.core.url_to_fs(source)
        if any(c in path for c in "*?["):
            found = {p: i for p, i in fs.glob(path, detail=True).items() if i.get("type") == "file"}
        elif fs.isdir(path):
            base = path.rstrip("/")
            # Hidden and underscore names (.tmp folders, _SUCCESS markers) are not data.
            found = {
                p: i
                for p, i in fs.find(path, detail=True).items()
                if not any(part.startswith((".", "_")) for part in posixpath.relpath(p, base).split("/"))
            }
        elif fs.isfile(path):
            found = {path: fs.info(path)}
        else:
            raise DataError(
                f"Nothing exists at the source {source}. Check the path or URI (a file, "
                "a folder or a glob of CSV, Parquet or JSON-lines files)."
            )
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - missing fsspec plugin (gcsfs/s3fs), credentials, permissions, bad URI
        raise DataError(explain(source, e, "read the source")) from None
    paths = sorted(found)
    local = on_disk(fs)
    named = [(p, p if local else fs.unstrip_protocol(p)) for p in paths]
    unknown = [name for p, name in named if file_format(p) is None]
    named = [(p, name) for p, name in named if file_format(p) is not None]
    if not named:
        raise DataError(
            f"No data files at {source}"
            + (f" (found {', '.join(unknown[:5])})" if unknown else "")
            + f". Data files must end in {', '.join(FORMATS)}; rename them or point at others."
        )
    return fs, named, {p: int(found[p].get("size") or 0) for p, _ in named}


def _check_output_outside_source(source: str, output: str, fs, files) -> None:
    # An output inside a source folder would be read back as input by the next run.
    try:
        out_fs, out_path = fsspec.core.url_to_fs(output)
    except Exception as e:  # noqa: BLE001 - as reading the source: any of fsspec's, said as the output's
        raise ConfigError(f"Cannot use the output {output}: {type(e).__name__}: {e}.") from None
    if type(out_fs) is not type(fs):
        return
    out = out_fs._strip_protocol(out_path).rstrip("/") + "/"
    src = fs._strip_protocol(fsspec.core.url_to_fs(source)[1]).rstrip("/") + "/"
    if out.startswith(src) or any(fs._strip_protocol(p).startswith(out) for p, _ in files):
        raise ConfigError(
            f"The output {output} is inside the source {source}; write it elsewhere so "
            "that prepared shards are not read back as input."
        )


def _non_finite_report(fs, files, spilled) -> dict[str, dict]:
    """{column: {"nan", "inf", "empty": cells, "first": [{"file", "line" or "row"}]}} over every file, in
    file order: the columns with NaN, infinite or empty numeric cells, and where the first few are."""
    found: dict[str, dict] = {}
    for (path, name), s in zip(files, spilled):
        nf = s.non_finite
        if not nf.counts:
            continue
        # A fast pass counted records: its first ones are named by their line, found now (only on these).
        text = nf.unit == "row" and file_format(path) != "parquet"
        lines = record_lines(fs, path, name, {i for f in nf.first.values() for i in f}) if text else {}
        for column, counts in nf.counts.items():
            entry = found.setdefault(column, {**dict.fromkeys(counts, 0), "first": []})
            for kind, n in counts.items():
                entry[kind] += n
            for at in nf.first[column]:
                if len(entry["first"]) < MAX_NON_FINITE_ROWS:
                    if nf.unit == "line" or text:
                        entry["first"].append({"file": name, "line": lines.get(at, at) if text else at})
                    else:
                        entry["first"].append({"file": name, "row": at + 1})
    return found


def _non_finite_message(found: dict[str, dict]) -> str:
    words = {"nan": "NaN", "inf": "infinite", "empty": "empty"}
    parts = []
    for column, entry in found.items():
        counts = ", ".join(f"{entry[k]} {w}" for k, w in words.items() if entry[k])
        at: dict[tuple[str, str], list[str]] = {}  # (file, "line" or "row") -> numbers, in order
        for f in entry["first"]:
            unit = "line" if "line" in f else "row"
            at.setdefault((f["file"], unit), []).append(str(f[unit]))
        where = "; ".join(f"{file} {unit}{'s' if len(n) > 1 else ''} {', '.join(n)}" for (file, unit), n in at.items())
        parts.append(f"column {column!r}: {counts} (first at {where})")
    return "The data has NaN, infinite or empty numeric cells, which training cannot use: " + "; ".join(parts) + "."


# ---------------------------------------------------------------- writing


def _write(output: str, manifests: dict[str, Manifest], write_splits) -> None:
    """The splits' shards, through `write_splits(fs, folders)`, then their manifests: into place at once on
    a local disk, the manifests last in an object store."""
    local = local_path(output)
    if local is not None:
        # Everything goes to a temporary sibling folder renamed into place at the end, so a
        # failure leaves either no output or the previous one intact.
        with atomic_directory(local) as tmp:
            write_splits(fsspec.filesystem("file"), {s: os.path.join(tmp, s) for s in SPLITS})
            for split, m in manifests.items():
                m.save(os.path.join(tmp, split, MANIFEST_NAME))
        for split, m in manifests.items():
            m.uri = posixpath.join(output.rstrip("/"), split, MANIFEST_NAME)
        return
    # Object stores cannot rename a folder. Remove the old manifests first, so that until the new
    # ones are written (last) no manifest points at half-written shards.
    fs, root = fsspec.core.url_to_fs(output)
    for split in SPLITS:
        old = posixpath.join(root, split, MANIFEST_NAME)
        if fs.exists(old):
            fs.rm(old)
    write_splits(fs, {s: posixpath.join(root, s) for s in SPLITS})
    for split, m in manifests.items():
        m.save(posixpath.join(output.rstrip("/"), split, MANIFEST_NAME))
        folder = posixpath.join(root, split)
        keep = {s.path for s in m.shards} | {MANIFEST_NAME}
        for p in fs.ls(folder, detail=False):  # shards of an earlier, larger run
            if posixpath.basename(p) not in keep:
                fs.rm(p)


def _write_splits(
    fs,
    folders: dict[str, str],
    rows: Iterator[pa.Table],
    n_eval: int,
    manifests: dict[str, Manifest],
    shard_rows: int,
    row_group_rows: int,
) -> None:
    """The first n_eval rows to eval's shards, the rest to train's."""
    first: list[pa.Table] = []  # the first DICTIONARY_SAMPLE_ROWS rows, whatever the sort units' size
    for table in rows:
        first.append(table)
        if sum(t.num_rows for t in first) >= DICTIONARY_SAMPLE_ROWS:
            break
    options = _parquet_options(pa.concat_tables(first))
    rows = itertools.chain(first, rows)
    del first  # or it would hold the first sort unit to the end
    threads = min(MAX_WRITER_THREADS, shuffle.usable_cpus())
    pool = _Writers(threads)
    writers = {s: _ShardWriter(fs, folders[s], manifests[s], shard_rows, row_group_rows, pool, options) for s in SPLITS}
    labels = {s: _LabelSummary(manifests[s].label) for s in SPLITS}
    stats = {s: ColumnStatistics() for s in SPLITS}
    try:
        position = 0
        for table in rows:
            head = max(0, min(n_eval - position, table.num_rows))
            if head:
                writers["eval"].write(table.slice(0, head))
                labels["eval"].add(table.slice(0, head))
                stats["eval"].add(table.slice(0, head))
            if head < table.num_rows:
                writers["eval"].close()
                writers["train"].write(table.slice(head))
                labels["train"].add(table.slice(head))
                stats["train"].add(table.slice(head))
            position += table.num_rows
            for w in writers.values():
                w.release()
            del table, head  # this sort unit's memory, before the next one is sorted
        for w in writers.values():
            w.close()
        pool.wait()
        for split, summary in labels.items():
            manifests[split].label_summary = summary.result()
            manifests[split].statistics = stats[split].result()
    finally:
        pool.shutdown()
        for w in writers.values():
            w.abort()


class _LabelSummary:
    """One split's numeric label, as the check at train start compares it with the other split and the model:
    its type, min and max, and for an integer or bool label the count of its distinct values while they are
    few. Built from the rows as they are written (no extra pass)."""

    def __init__(self, label: str | None):
        self.label, self.type, self.integral = label, None, False
        self.min = self.max = None
        self.distinct: set | None = set()

    def add(self, table: pa.Table) -> None:
        if self.label is None or self.label not in table.column_names or not table.num_rows:
            return
        column = table.column(self.label)
        t = column.type
        integral = pa.types.is_integer(t) or pa.types.is_boolean(t)
        if not (integral or pa.types.is_floating(t)):
            return
        self.type, self.integral = TYPE_NAMES.get(t, str(t)), integral
        low, high = pc.min_max(column).values()
        if low.as_py() is None:  # no value (prep refuses, drops or fills empty numeric cells)
            return
        self.min = low.as_py() if self.min is None else min(self.min, low.as_py())
        self.max = high.as_py() if self.max is None else max(self.max, high.as_py())
        if self.distinct is not None and integral:
            self.distinct.update(pc.unique(column.drop_null()).to_pylist())
            if len(self.distinct) > MAX_DISTINCT_LABELS:
                self.distinct = None

    def result(self) -> dict:
        if self.type is None or self.min is None:
            return {}
        out = {"type": self.type, "min": self.min, "max": self.max}
        if self.distinct is not None and self.integral:
            out["distinct"] = len(self.distinct)
        return out


class _Writers:
    """Threads writing whole shards; at most one more shard in flight than threads (memory)."""

    def __init__(self, threads: int):
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="prep-write")
        self._limit = threads + 1
        self._pending: collections.deque = collections.deque()

    def submit(self, fn, *args) -> None:
        while len(self._pending) >= self._limit:
            self._pending.popleft().result()  # raises what the write raised
        self._pending.append(self._pool.submit(fn, *args))

    def wait(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)  # no write left running on a failure


def _write_shard(fs, path: str, table: pa.Table, row_group_rows: int, options: dict) -> None:
    with _open_output(fs, path) as f:
        # Small row groups let a worker read just the groups its task's range spans.
        pq.write_table(table, f, row_group_size=row_group_rows, **options)


def _open_output(fs, path: str):
    # pyarrow writes a local file itself: through fsspec's file object it makes a Python call per page.
    return pa.OSFile(path, "wb") if on_disk(fs) else fs.open(path, "wb")


class _ShardWriter:
    """One split's rows, in order, as shards of shard_rows rows in row groups of row_group_rows.

    What is written is copied into one contiguous table first, so a shard's bytes depend on its rows
    only, and a shard waiting for a writer thread holds no more memory than its own. A shard that fits
    in SHARD_BUFFER_BYTES is written whole by pq.write_table, on a writer thread; a bigger one (wide rows, large
    shard_rows) streams to its file here, whole row groups at a time. Both give the same bytes."""

    def __init__(
        self,
        fs,
        folder: str,
        manifest: Manifest,
        shard_rows: int,
        row_group_rows: int,
        writers: _Writers,
        options: dict,
    ):
        if on_disk(fs):
            fs.makedirs(folder, exist_ok=True)  # an object store has no folders (s3fs's would create a bucket)
        self.fs, self.folder, self.manifest, self.writers, self.options = fs, folder, manifest, writers, options
        self.shard_rows, self.group_rows = shard_rows, row_group_rows
        self._pieces: list[pa.Table] = []  # the shard's rows not written yet
        self._pending_rows = 0
        self._pending_bytes = 0.0
        self._rows = 0  # the shard's rows, written or pending
        self._file = self._writer = None

    def write(self, table: pa.Table) -> None:
        row_bytes = table.nbytes / max(table.num_rows, 1)
        offset = 0
        while offset < table.num_rows:
            n = min(self.shard_rows - self._rows, table.num_rows - offset)
            self._pieces.append(table.slice(offset, n))
            offset += n
            self._rows += n
            self._pending_rows += n
            self._pending_bytes += n * row_bytes
            if self._rows == self.shard_rows:
                self._end_shard()
            elif self._pending_bytes > SHARD_BUFFER_BYTES:
                self._stream()

    def close(self) -> None:
        if self._rows:
            self._end_shard()

    def release(self) -> None:
        """Copy the rows waiting for the rest of their shard, so they no longer hold their sort unit."""
        if len(self._pieces) > 1 or self._pieces and self._pieces[0].num_rows:
            self._pieces = [compact(pa.concat_tables(self._pieces))]

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None

    def _path(self) -> str:
        return f"part-{len(self.manifest.shards):05d}.parquet"

    def _stream(self) -> None:
        """Write the pending whole row groups to the shard's file; keep the rest."""
        whole = self._pending_rows - self._pending_rows % self.group_rows
        if not whole:
            return
        pending = pa.concat_tables(self._pieces)
        if self._writer is None:
            self._file = _open_output(self.fs, posixpath.join(self.folder, self._path()))
            self._writer = pq.ParquetWriter(self._file, pending.schema, **self.options)
        self._writer.write_table(compact(pending.slice(0, whole)), row_group_size=self.group_rows)
        self._pieces = [pending.slice(whole)]
        self._pending_bytes *= (self._pending_rows - whole) / self._pending_rows
        self._pending_rows -= whole

    def _end_shard(self) -> None:
        path = self._path()
        table = compact(pa.concat_tables(self._pieces))
        if self._writer is None:
            self.writers.submit(
                _write_shard, self.fs, posixpath.join(self.folder, path), table, self.group_rows, self.options
            )
        else:
            if table.num_rows:
                self._writer.write_table(table, row_group_size=self.group_rows)
            self._writer.close()
            self._file.close()
            self._file = self._writer = None
        self.manifest.shards.append(Shard(path=path, rows=self._rows))
        self._pieces, self._pending_rows, self._pending_bytes, self._rows = [], 0, 0.0, 0


def _parquet_options(sample: pa.Table) -> dict:
    """Parquet's options: dictionary pages for the columns whose values repeat (at most one distinct
    in 8), judged on the first rows in key order, so the same for the same inputs and seed. Elsewhere (ids, measured
    floats) trying a dictionary for every row group costs up to half the write speed, and snappy
    already shrinks plain pages as well (measured on the samples and bench data)."""
    sample = sample.slice(0, DICTIONARY_SAMPLE_ROWS)
    return {
        "use_dictionary": [
            c
            for c in sample.column_names
            if pc.count_distinct(sample.column(c)).as_py() <= max(1, sample.num_rows // 8)
        ],
        # Min/max of shuffled rows prune no row group, and cost a sixth of the write.
        "write_statistics": False,
    }


def _check_replaceable(path: str, output: str) -> None:
    # The output folder is replaced as a whole: never do that to a folder holding anything else.
    if os.path.isfile(path):
        raise ConfigError(f"The output {output} is a file; pass a folder to write train/ and eval/ to.")
    if os.path.isdir(path):
        others = sorted(set(os.listdir(path)) - {"train", "eval"})
        if others:
            raise ConfigError(
                f"The output folder {output} already holds {', '.join(others[:3])}; data prep "
                "replaces its output folder as a whole, so pass a new or empty folder."
            )
