"""Reading and validating one source file (CSV, Parquet or JSON lines) as a stream of Arrow tables.

pyarrow parses each file (fast path), a few MB at a time. Only when pyarrow rejects a file, or its
label column has gaps, is the file parsed again by the precise Python pass below, which knows the
line of every record and so can name the file, line and column of each bad row (and, when asked
to, skip them). Types are those pyarrow's whole-file read would infer, kept to the five a manifest
holds; `combine` then checks the files against each other.

A file's stream may yield RESTART: everything it yielded before is void (a later block showed the
types the first one suggested were too narrow, or the file needs the precise pass), and it starts
again from its first row.
"""

from __future__ import annotations

import codecs
import collections
import concurrent.futures
import csv
import io
import json
import posixpath
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from elastic_step.errors import DataError
from elastic_step.util.storage import on_disk

TYPES = {
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "string": pa.string(),
    "bool": pa.bool_(),
}
TYPE_NAMES = {t: name for name, t in TYPES.items()}
FORMATS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet", ".jsonl": "json", ".json": "json"}
MAX_BAD_ROWS = 20  # kept in the manifest; the count covers all of them
SKIP_HINT = (
    "Fix or delete that row, or set on_bad_rows to 'skip' (CLI: --on-bad-rows skip) to skip "
    "bad rows; skipped rows are counted in the manifest."
)
RESTART = "restart"
# What prep does with NaN, infinite and empty cells of numeric and bool columns (parameter non_finite).
NON_FINITE = ("fail", "drop", "zero")
NON_FINITE_HINT = (
    "Fix the data, or pass --non-finite drop to drop those rows or --non-finite zero to set those "
    "cells to 0 (pipeline parameter non_finite); either is counted in the manifest."
)
MAX_NON_FINITE_ROWS = 5  # first rows named per column; the counts cover all of them

# CSV is read in chunks of whole rows parsed on all CPUs, or, once a quote is seen, by pyarrow's
# streaming reader, which reads up to 32 blocks ahead: 512 KB blocks keep that to ~20 MB of Arrow memory.
# CSV_CHUNKS_AHEAD parsed chunks wait ahead of the reader: ~70 MB. JSON is cut into chunks of whole lines;
# Parquet is read by batches.
CSV_CHUNK_BYTES = 8 << 20
CSV_BLOCK_BYTES = 512 << 10
CSV_CHUNKS_AHEAD = 6
JSON_CHUNK_BYTES = 4 << 20
PARQUET_BATCH_BYTES = 4 << 20
PRECISE_BATCH_ROWS = 16_384

# pyarrow's CSV defaults, mirrored by the precise pass. Only an empty field is missing: "NA" or
# "null" are real values in a string column (and a bad value in a numeric one).
_TRUE, _FALSE = ("1", "True", "TRUE", "true"), ("0", "False", "FALSE", "false")
_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*(e[+-]?\d+)?|\.\d+(e[+-]?\d+)?|inf|infinity|nan)", re.IGNORECASE)


def file_format(path: str) -> str | None:
    return FORMATS.get(posixpath.splitext(path)[1].lower())


class BadRow:
    def __init__(self, file: str, line: int, column: str | None, reason: str, unit: str = "line"):
        self.file, self.line, self.column, self.reason, self.unit = file, line, column, reason, unit
        # line: 1-based as an editor shows it (CSV header = line 1); a row number for Parquet

    def message(self) -> str:
        where = f", column {self.column!r}" if self.column else ""
        return f"Bad row in {self.file} {self.unit} {self.line}{where}: {self.reason}. {SKIP_HINT}"


class BadRows:
    """Fails on the first bad row, or counts it and keeps the first few for the manifest."""

    def __init__(self, skip: bool):
        self.skip = skip
        self.count = 0
        self.first: list[dict[str, Any]] = []
        self.last: BadRow | None = None

    def add(self, bad: BadRow) -> None:
        if not self.skip:
            raise DataError(bad.message())
        self.count += 1
        self.last = bad
        if len(self.first) < MAX_BAD_ROWS:
            self.first.append({"file": bad.file, "line": bad.line, "column": bad.column, "reason": bad.reason})


class SourceFile:
    """One source file as a stream of tables (`batches()`); `schema` holds its types once it ends.

    The tables' columns have the five manifest types (or null). A CSV or Parquet file's tables all
    have `schema`; a JSON-lines file's may lack a key or hold a narrower type (null, or int64 where
    the file turns out float64): `conform` makes them whole."""

    def __init__(
        self, fs, path: str, name: str, declared: dict[str, pa.DataType] | None, label: str | None, bad: BadRows
    ):
        self.fs, self.path, self.name, self.declared, self.label, self.bad = fs, path, name, declared, label, bad
        self.schema: pa.Schema | None = None
        self.rows = 0  # rows of the final attempt, after bad ones
        # The lines of the rows of the table last yielded, when the precise pass knows them (else None:
        # the rows are the file's records in order, none skipped).
        self.lines: np.ndarray | None = None

    def batches(self) -> Iterator[pa.Table | str]:
        fmt = file_format(self.path)
        try:
            for item in self._parquet() if fmt == "parquet" else self._csv() if fmt == "csv" else self._json():
                if item is RESTART:
                    self.rows = 0
                elif item.num_rows:
                    self.rows += item.num_rows
                yield item
        except OSError as e:
            raise DataError(f"Cannot read {self.name}: {e}. Check that it exists and the step may read it.") from None
        except (UnicodeDecodeError, _Binary):
            if fmt == "parquet":
                raise
            raise _not_utf8(self.fs, self.path, self.name) from None
        _check_not_all_bad(self.rows, self.name, self.bad)

    # ------------------------------------------------------------ Parquet

    def _parquet(self) -> Iterator[pa.Table]:
        name, label, declared = self.name, self.label, self.declared
        with _open_binary(self.fs, self.path) as f:
            try:
                # pre_buffer (pyarrow's default) reads ahead every row group of the file: 600 MB of a
                # 600 MB file, measured; buffered: a huge row group is not read whole either.
                pf = pq.ParquetFile(f, buffer_size=1 << 20, pre_buffer=False)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise _not_parquet(name, e) from None
            schema = _supported(pf.schema_arrow.empty_table(), name).schema
            if declared is not None:
                _check_columns(schema.names, declared, name)
                for c, t in declared.items():  # the types are known before any row is read
                    _cast_declared(pa.chunked_array([], schema.field(c).type), t, c, name)
                schema = pa.schema(list(declared.items()))
            md = pf.metadata
            row_bytes = sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups)) / max(md.num_rows, 1)
            batches = pf.iter_batches(batch_size=max(1024, int(PARQUET_BATCH_BYTES / max(row_bytes, 1))))
            seen = 0
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise _not_parquet(name, e) from None
                table = _supported(pa.Table.from_batches([batch]), name)
                if declared is not None:
                    table = pa.table({c: _cast_declared(table.column(c), t, c, name) for c, t in declared.items()})
                if label is not None and label in table.column_names and table.column(label).null_count:
                    # Parquet has no lines: report 1-based row numbers.
                    missing = table.column(label).is_null().to_numpy(zero_copy_only=False).nonzero()[0]
                    for i in missing:
                        self.bad.add(BadRow(name, seen + int(i) + 1, label, "the label is missing", unit="row"))
                    table = table.filter(table.column(label).is_valid())
                seen += batch.num_rows
                yield table
        self.schema = schema

    # ------------------------------------------------------------ CSV

    def _csv(self) -> Iterator[pa.Table | str]:
        header = _csv_header(self.fs, self.path, self.name)
        if self.declared is not None:
            _check_columns(header, self.declared, self.name)
        types = dict(self.declared) if self.declared is not None else None
        try:
            gaps = yield from self._arrow_csv(types, header)
            if gaps is None:
                return
            types = gaps  # the label has gaps: the precise pass names their lines
        except pa.ArrowInvalid:
            pass  # a bad row; the precise pass finds it
        yield RESTART
        yield from self._precise(lambda: _csv_records(self.fs, self.path, self.name, header), header, types, text=True)

    def _arrow_csv(self, types, header):
        """Yield the file's tables; return None, or the file's types when its label has gaps."""
        name, label = self.name, self.label
        whole_file = types is not None  # types known for the whole file: a conversion error is a bad row
        reader = _CsvReader(self.fs, self.path, types or {})
        try:
            if types is None:
                # pyarrow infers ISO dates as timestamps; keep the text as written instead.
                temporal = {f.name: pa.string() for f in reader.schema if pa.types.is_temporal(f.type)}
                if temporal:
                    reader.close()
                    reader = _CsvReader(self.fs, self.path, temporal)
            yielded, gaps, unsupported = False, False, None
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
                except pa.ArrowInvalid:
                    if whole_file:
                        raise
                    # The streaming reader infers types from the first block only; a later value that
                    # does not fit them is no error for a whole-file read, which loosens the type
                    # instead. Find the types it would give, and read the file again with them.
                    types, whole_file = _csv_file_types(self.fs, self.path, header), True
                    reader.close()
                    reader = _CsvReader(self.fs, self.path, types)
                    if yielded:
                        yield RESTART
                    yielded, gaps, unsupported = False, False, None
                    continue
                if unsupported or gaps:
                    continue  # read on: a malformed row further down takes the precise pass instead
                try:
                    table = _supported(pa.Table.from_batches([batch]), name)
                except DataError as e:
                    unsupported = e
                    continue
                if label is not None and label in table.column_names and table.column(label).null_count:
                    gaps = True
                    continue
                yield table
                yielded = True
            if unsupported:
                raise unsupported
            schema = _supported(reader.schema.empty_table(), name).schema
        finally:
            reader.close()
        if gaps:
            return schema_types(schema)
        self.schema = schema
        return None

    # ------------------------------------------------------------ JSON lines

    def _json(self) -> Iterator[pa.Table | str]:
        declared = self.declared
        types = dict(declared) if declared is not None else None
        try:
            gaps = yield from self._arrow_json()
            if gaps is None:
                return
            types = gaps
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            pass  # a bad row, or a key holding numbers here and text there; the precise pass finds it
        yield RESTART
        columns = list(types) if types is not None else None
        yield from self._precise(
            lambda: _json_records(self.fs, self.path, self.name),
            columns,
            types,
            text=False,
            declared=declared is not None,
        )

    def _arrow_json(self):
        """Yield the file's tables; return None, or the file's types when its label has gaps."""
        name, label, declared = self.name, self.label, self.declared
        explicit = pa.schema(list(declared.items())) if declared is not None else None
        schema, gaps, unlabelled, unsupported = None, False, False, False
        rows, values = 0, collections.Counter()
        dates: dict[str, bool] = {}  # key -> every value so far a date (so, for the whole file, a date)
        for chunk in _line_chunks(self.fs, self.path):
            table = _arrow_json(chunk, explicit, "error" if declared is not None else "infer")
            if declared is None:
                for f in table.schema:
                    if not pa.types.is_null(f.type):
                        dates[f.name] = dates.get(f.name, True) and pa.types.is_temporal(f.type)
                temporal = [(f.name, pa.string()) for f in table.schema if pa.types.is_temporal(f.type)]
                if temporal:  # keep dates as written, as for CSV
                    table = _arrow_json(chunk, pa.schema(temporal), "infer").select(table.column_names)
                # As pyarrow's whole-file read: a key's type widens null -> any and int -> float;
                # any other change (number here, text there) raises, for the precise pass.
                schema = (
                    table.schema
                    if schema is None
                    else pa.unify_schemas([schema, table.schema], promote_options="permissive")
                )
            else:
                schema = explicit
                rows += table.num_rows
                values.update({c: table.num_rows - table.column(c).null_count for c in declared})
            if unsupported or gaps:
                continue
            try:
                table = _supported(table, name)
            except DataError:
                unsupported = True  # raised for the whole file's types, once it is read
                continue
            if label is not None:
                if label in table.column_names:
                    if table.column(label).null_count:
                        gaps = True
                        continue
                elif table.num_rows:
                    unlabelled = True  # no label in this chunk: a gap if the key appears later
            yield table
        if declared is not None:
            _check_json_columns(rows, values, declared, name)
        else:  # the whole-file read that found dates read the file again, those keys first
            first = [f for f in schema if dates.get(f.name)]
            schema = pa.schema(first + [f for f in schema if not dates.get(f.name)])
        schema = _supported(schema.empty_table(), name).schema
        if label is not None and label in schema.names and (gaps or unlabelled):
            return schema_types(schema)
        self.schema = schema
        return None

    # ------------------------------------------------------------ the precise pass

    def _precise(
        self, open_records: Callable[[], Iterator[tuple[int, Any]]], columns, types, text: bool, declared: bool = False
    ) -> Iterator[pa.Table]:
        """Parse the records (from _csv_records / _json_records) value by value, naming each bad row.
        Inferring types needs every value first: then the file is read twice."""
        name, label, bad = self.name, self.label, self.bad
        if types is None:
            columns, types = _infer(open_records(), columns, text, name)
        convert = _from_text if text else _from_json
        values: dict[str, list] = {c: [] for c in columns}
        lines: list[int] = []
        rows, pending, present = 0, 0, collections.Counter()

        def table() -> pa.Table:
            t = pa.table({c: pa.array(values[c], type=types[c]) for c in columns})
            for c in columns:
                present[c] += t.num_rows - t.column(c).null_count
                values[c] = []
            self.lines = np.array(lines, dtype=np.int64)
            lines.clear()
            return t

        for line, record in open_records():
            if isinstance(record, BadRow):
                bad.add(record)
                continue
            extra = [k for k in record if k not in types]
            if extra:  # only with a declared schema: an undeclared key is a schema mismatch, not a bad row
                raise DataError(
                    f"{name} line {line} has column {extra[0]!r}, which the schema does not "
                    "declare. Add it to the schema or remove it from the data."
                )
            row, problem = {}, None
            for c in columns:
                raw = record.get(c)
                try:
                    row[c] = None if raw is None else convert(raw, types[c])
                except ValueError as e:
                    problem = BadRow(name, line, c, str(e))
                    break
                if row[c] is None and c == label:
                    problem = BadRow(name, line, c, "the label is missing")
                    break
            if problem:
                bad.add(problem)
                continue
            for c in columns:
                values[c].append(row[c])
            lines.append(line)
            rows, pending = rows + 1, pending + 1
            if pending == PRECISE_BATCH_ROWS:
                yield table()
                pending = 0
        if pending:
            yield table()
        if declared:
            _check_json_columns(rows, present, types, name)
        self.schema = pa.schema([(c, types[c]) for c in columns])


def schema_types(schema: pa.Schema) -> dict[str, pa.DataType]:
    return {f.name: f.type for f in schema}


def _not_parquet(name: str, e: Exception) -> DataError:
    return DataError(
        f"{name} is not a readable Parquet file: {e}. Re-export it, or give it the extension of its real format."
    )


def _local_path(fs, path: str) -> str | None:
    return path if on_disk(fs) else None


def _open_binary(fs, path: str):
    # A local file is read by pyarrow itself (no Python in the loop); anything else through fsspec.
    local = _local_path(fs, path)
    return pa.OSFile(local) if local is not None else fs.open(path, "rb")


def _convert_options(column_types) -> pa_csv.ConvertOptions:
    return pa_csv.ConvertOptions(
        column_types=column_types,
        null_values=[""],
        strings_can_be_null=True,
        true_values=list(_TRUE),
        false_values=list(_FALSE),
    )


_CSV_PARSE = pa_csv.ParseOptions(newlines_in_values=True)


class _CsvReader:
    """A file's CSV record batches, in order; types from the first part read (`schema`) unless given.

    In text without a quote, every LF ends a row, so the file is read in chunks of CSV_CHUNK_BYTES
    cut after an LF, each parsed by pyarrow.csv.read_csv on all CPUs, up to CSV_CHUNKS_AHEAD chunks
    ahead on a thread while this one is used. From the first chunk holding a quote (a quoted value may
    hold a newline) the rest streams through pyarrow.csv.open_csv, which parses on one CPU.
    (pyarrow's dataset scanner parses faster, but buffers parsed blocks without bound when its
    reader is slower than it: 750 MB for 400 blocks of 512 KB, measured.)"""

    def __init__(self, fs, path: str, column_types: dict):
        self._file = _open_binary(fs, path)
        self._types, self._names = dict(column_types), None
        self._stream = None
        self._batches: collections.deque = collections.deque()
        self._ahead = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="csv-chunk")
        self._queue: collections.deque = collections.deque()  # chunks read and parsed ahead, in order
        self._offset = 0  # where the next chunk starts: a row's start
        self._eof = False
        try:
            first = self._parse(self._read_chunk())
            if first is None:
                self.schema = self._stream.schema
            else:
                self.schema = first.schema
                self._batches.extend(first.to_batches())
                self._fix_types()
                self._read_ahead()
        except BaseException:
            self.close()
            raise

    def read_next_batch(self) -> pa.RecordBatch:
        while not self._batches:
            if not self._queue:
                if self._stream is not None:
                    return self._stream.read_next_batch()
                raise StopIteration
            table = self._queue.popleft().result()
            if table is None:
                raise StopIteration
            self._read_ahead()
            self._batches.extend(table.to_batches())
        return self._batches.popleft()

    def _read_ahead(self) -> None:
        # Several chunks, not one: bucketing a batch (a spill buffer's flush) takes longer than
        # parsing the next chunk, and one chunk ahead left a CPU idle meanwhile.
        while len(self._queue) < CSV_CHUNKS_AHEAD and self._stream is None:
            self._queue.append(self._ahead.submit(self._read_and_parse))

    def __iter__(self):
        while True:
            try:
                yield self.read_next_batch()
            except StopIteration:
                return

    def close(self) -> None:
        for future in self._queue:
            future.cancel()
        for future in self._queue:
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - the chunk's error is read (or not) anew by whoever reads the file again
                pass
        self._queue.clear()
        self._ahead.shutdown(wait=True)
        if self._stream is not None:
            try:
                self._stream.close()
            except pa.ArrowException:
                pass  # what its read-ahead met: this reader is given up, the error is read (or not) anew
        self._file.close()

    def _read_chunk(self) -> pa.Buffer | None:
        """The next chunk of whole rows, or None (from here on the file streams)."""
        self._file.seek(self._offset)
        data = self._file.read(CSV_CHUNK_BYTES)
        at_end = len(data) < CSV_CHUNK_BYTES
        end = len(data) if at_end else data.rfind(b"\n") + 1
        if not end or data.find(b'"', 0, end) >= 0:
            self._file.seek(self._offset)
            return None
        self._offset += end
        self._eof = at_end
        return pa.py_buffer(data).slice(0, end)  # not a copy

    def _parse(self, chunk: pa.Buffer | None) -> pa.Table | None:
        if chunk is None:
            read = pa_csv.ReadOptions(block_size=CSV_BLOCK_BYTES, column_names=self._names)
            self._stream = pa_csv.open_csv(
                self._file, read_options=read, parse_options=_CSV_PARSE, convert_options=_convert_options(self._types)
            )
            return None
        read = pa_csv.ReadOptions(column_names=self._names)
        return pa_csv.read_csv(
            pa.BufferReader(chunk),
            read_options=read,
            parse_options=_CSV_PARSE,
            convert_options=_convert_options(self._types),
        )

    def _read_and_parse(self) -> pa.Table | None:
        """The next chunk's rows; no rows when the rest now streams; None at the end."""
        if self._stream is not None:
            return self._stream.schema.empty_table()  # a chunk before switched to streaming
        if self._eof:
            return None
        table = self._parse(self._read_chunk())
        return self._stream.schema.empty_table() if table is None else table

    def _fix_types(self) -> None:
        # Later chunks are read as the first one was, as a stream is: a value that does not fit is an error.
        self._names = self.schema.names
        self._types = {f.name: f.type for f in self.schema}


def _csv_file_types(fs, path, header) -> dict[str, pa.DataType]:
    """The types pyarrow's whole-file read infers for each column, found a block at a time.

    pyarrow tries int64, bool, date, time, timestamps, float64, then text (binary when not UTF-8),
    and takes the first type every value of the column converts to. Dates, times and timestamps
    become text here, and no value converts both to one of them and to a number or a bool, so
    int64, bool and float64 are the types to test: each with pyarrow's own converter, on the
    block's values of the column written out as a one-column CSV. A malformed row raises."""
    candidates = (pa.int64(), pa.bool_(), pa.float64())
    alive = {c: list(candidates) for c in header}
    has_value = dict.fromkeys(header, False)
    utf8 = dict.fromkeys(header, True)
    reader = _CsvReader(fs, path, {c: pa.binary() for c in header})
    try:
        for batch in reader:
            for c in header:
                values = batch.column(c).drop_null()
                if not len(values):
                    continue
                has_value[c] = True
                if utf8[c]:
                    try:
                        values.cast(pa.string())
                    except pa.ArrowInvalid:
                        utf8[c] = False
                if alive[c]:
                    text = _one_column_csv(values)
                    alive[c] = [t for t in alive[c] if _converts(text, t)]
    finally:
        reader.close()
    return {
        c: (pa.null() if not has_value[c] else alive[c][0] if alive[c] else pa.string() if utf8[c] else pa.binary())
        for c in header
    }


def _one_column_csv(values: pa.Array) -> bytes:
    """`values` (binary) as the text of a CSV file with one column, each value quoted."""
    quoted = pc.binary_join_element_wise(b'"', pc.replace_substring(values, b'"', b'""'), b'"\n', b"")
    offsets = np.frombuffer(quoted.buffers()[1], dtype=np.int32)[quoted.offset : quoted.offset + len(quoted) + 1]
    return b"c\n" + memoryview(quoted.buffers()[2])[offsets[0] : offsets[-1]].tobytes()


def _converts(text: bytes, t: pa.DataType) -> bool:
    try:
        pa_csv.read_csv(
            pa.BufferReader(text),
            read_options=pa_csv.ReadOptions(use_threads=False),
            parse_options=_CSV_PARSE,
            convert_options=_convert_options({"c": t}),
        )
        return True
    except pa.ArrowInvalid:
        return False


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
    """(first line of the record, {column: text} or a BadRow), header skipped."""
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
                yield line, BadRow(name, line, column, f"it has {len(row)} fields but the header has {len(header)}")
                continue
            yield line, dict(zip(header, row))


def _line_chunks(fs, path) -> Iterator[bytes]:
    """The file in chunks of whole lines (an empty file: one empty chunk, as a whole-file read sees it)."""
    with _open_binary(fs, path) as f:
        rest, first = b"", True
        while True:
            data = f.read(JSON_CHUNK_BYTES)
            if not data:
                if rest or first:
                    yield rest
                return
            first = False
            data = rest + data if rest else data
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # a line longer than a chunk: read on
                rest = data
                continue
            yield data[:cut]
            rest = data[cut:]


def _arrow_json(data: bytes, explicit, unexpected) -> pa.Table:
    return pa_json.read_json(
        pa.BufferReader(data),
        parse_options=pa_json.ParseOptions(explicit_schema=explicit, unexpected_field_behavior=unexpected),
    )


def _json_records(fs, path, name) -> Iterator[tuple[int, Any]]:
    with _open_text(fs, path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                yield line, BadRow(name, line, None, f"it is not valid JSON ({e.msg})")
                continue
            if not isinstance(record, dict):
                yield line, BadRow(name, line, None, "it is not a JSON object")
                continue
            yield line, record


def _check_json_columns(rows: int, values: dict[str, int], declared, name) -> None:
    # JSON rows may omit keys, so a declared column never set in the whole file is the "missing column".
    if rows:
        for c in declared:
            if not values[c]:
                raise DataError(
                    f"Column {c!r} of the schema has no value in {name}. Fix the schema "
                    "or the data so that they name the same columns."
                )


# ---------------------------------------------------------------- the precise pass's conversions


def _from_text(s: str, t: pa.DataType):
    if s == "":
        return None
    if t == pa.string():
        return s
    if t == pa.int64() and _INT.fullmatch(s) and -(2**63) <= int(s) < 2**63:
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
        ok = isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63
    else:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if not ok:
        raise ValueError(f"cannot read {json.dumps(v)[:60]} as {TYPE_NAMES.get(t, t)}")
    return v


def _infer(records, columns, text: bool, name: str) -> tuple[list[str], dict[str, pa.DataType]]:
    """(columns, types) of the records, value by value; JSON's columns in order of first appearance."""
    seen: dict[str, None] = dict.fromkeys(columns) if columns is not None else {}
    fits: dict[str, list[pa.DataType]] = {}  # text: the types every value so far fits, in pyarrow's order
    kinds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # JSON
    nested: set[str] = set()
    for _, r in records:
        if not isinstance(r, dict):
            continue
        for c, v in r.items():
            if columns is None:
                seen.setdefault(c)
            if v is None:
                continue
            if text:
                if v == "":
                    continue
                alive = fits.setdefault(c, [pa.int64(), pa.bool_(), pa.float64()])
                if alive:
                    fits[c] = [t for t in alive if _fits(v, t)]
            elif isinstance(v, (dict, list)):
                nested.add(c)
            else:
                kinds[c][
                    "bool"
                    if isinstance(v, bool)
                    else "str"
                    if isinstance(v, str)
                    else "int"
                    if isinstance(v, int)
                    else "float"
                ] += 1
    columns = list(seen)
    types = {}
    for c in columns:
        if text:  # pyarrow's CSV order: the first type every value fits
            types[c] = pa.null() if c not in fits else fits[c][0] if fits[c] else pa.string()
            continue
        if c in nested:
            raise DataError(
                f"Column {c!r} of {name} holds nested JSON values; elastic-step reads flat "
                "records of numbers, strings and booleans. Flatten the data first."
            )
        # pyarrow gives up on a column mixing kinds; the majority kind wins here, so that
        # the odd values become bad rows that name their line.
        k = kinds[c]
        numbers = k["int"] + k["float"]
        if not k:
            types[c] = pa.null()
        elif numbers >= max(k["bool"], k["str"]):
            types[c] = pa.float64() if k["float"] else pa.int64()
        else:
            types[c] = pa.bool_() if k["bool"] > k["str"] else pa.string()
    return columns, types


def _fits(s: str, t: pa.DataType) -> bool:
    try:
        _from_text(s, t)
        return True
    except ValueError:
        return False


def _check_not_all_bad(rows: int, name: str, bad: BadRows) -> None:
    # Skipping every row hides a wrong file or schema behind an empty data set.
    if rows == 0 and bad.last is not None and bad.last.file == name:
        raise DataError(
            f"Every row of {name} is bad, e.g. {bad.last.unit} {bad.last.line}: "
            f"{bad.last.reason}. Check that the file matches the schema."
        )


# ---------------------------------------------------------------- NaN, infinite and empty cells


class NonFinite:
    """The NaN, infinite and empty cells of one file's numeric and bool columns, which training cannot use:
    counts per column and the first few rows of each, as 1-based lines (`unit` "line") or, for rows a
    fast pass read, 0-based indices among the file's records (`unit` "row", see `name_rows`)."""

    KINDS = ("nan", "inf", "empty")

    def __init__(self):
        self.counts: dict[str, dict[str, int]] = {}  # column -> kind -> cells
        self.first: dict[str, list[int]] = {}  # column -> the first rows (as `unit` says)
        self.unit = "row"
        self.rows = 0  # rows with any such cell

    def scan(self, table: pa.Table, at: np.ndarray) -> np.ndarray | None:
        """Count `table`'s cells; `at`: where each row is (in `unit`). The mask of its rows with any, or None."""
        found = None
        for name in table.column_names:
            column = table.column(name)
            t = column.type
            if not (pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_boolean(t)):
                continue
            if not column.null_count and not (pa.types.is_floating(t) and not np.isfinite(pc.sum(column).as_py() or 0)):
                continue  # one pass: a sum is finite unless a value is NaN or infinite (or it overflows)
            masks = {"empty": column.is_null()}
            if pa.types.is_floating(t):
                masks["nan"] = pc.fill_null(pc.is_nan(column), False)
                masks["inf"] = pc.fill_null(pc.is_inf(column), False)
            counts = {k: pc.sum(m).as_py() or 0 for k, m in masks.items()}
            if not any(counts.values()):
                continue
            column_counts = self.counts.setdefault(name, dict.fromkeys(self.KINDS, 0))
            for k, n in counts.items():
                column_counts[k] += n
            bad = np.zeros(table.num_rows, dtype=bool)
            for m in masks.values():
                bad |= m.to_numpy(zero_copy_only=False)
            first = self.first.setdefault(name, [])
            if len(first) < MAX_NON_FINITE_ROWS:
                first += at[np.flatnonzero(bad)[: MAX_NON_FINITE_ROWS - len(first)]].tolist()
            found = bad if found is None else found | bad
        if found is not None:
            self.rows += int(found.sum())
        return found

    def reset(self) -> None:
        self.__init__()


def treat_non_finite(table: pa.Table, bad: np.ndarray | None, policy: str) -> pa.Table:
    """`table` as `policy` says: rows with NaN, infinite or empty numeric cells dropped, or those cells set to 0."""
    if bad is None or policy == "fail":
        return table
    if policy == "drop":
        return table.filter(pa.array(~bad))
    columns = []
    for column in table.columns:
        t = column.type
        if pa.types.is_floating(t):
            column = pc.if_else(pc.or_(pc.is_nan(column), pc.is_inf(column)), pa.scalar(0, t), column)
        if pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_boolean(t):
            column = pc.fill_null(column, pa.scalar(False if pa.types.is_boolean(t) else 0, t))
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=table.schema)


def record_lines(fs, path: str, name: str, rows: set[int]) -> dict[int, int]:
    """{record index: its first line} for the given 0-based indices of a CSV or JSON-lines file's records
    (as a fast pass counts them: blank lines are no records), read up to the last one asked for."""
    fmt, out, last = file_format(path), {}, max(rows, default=-1)
    if fmt not in ("csv", "json") or last < 0:
        return out
    records = (
        _csv_records(fs, path, name, _csv_header(fs, path, name)) if fmt == "csv" else _json_records(fs, path, name)
    )
    for i, (line, _) in enumerate(records):
        if i in rows:
            out[i] = line
        if i >= last:
            break
    return out


# ---------------------------------------------------------------- types and columns


class _Binary(DataError):
    """A column of bytes: in a CSV or JSON file, text that is not UTF-8 (said as such by SourceFile)."""


def _not_utf8(fs, path: str, name: str) -> DataError:
    """The error for a text file that is not UTF-8, naming the line (as an editor counts them), the CSV
    column and the line's text around the first byte that is not."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    line, tail = 1, b""  # tail: the bytes of the current line before this chunk
    with _open_binary(fs, path) as f:
        while True:
            data = f.read(1 << 20)
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                at = max(0, e.start - (len(e.object) - len(data)))  # e.object: the decoder's pending bytes + data
                line += data.count(b"\n", 0, at)
                start = data.rfind(b"\n", 0, at) + 1
                text = (tail if start == 0 else b"") + data[start:].split(b"\n", 1)[0]
                column = _csv_column(fs, path, text, at - start + (len(tail) if start == 0 else 0))
                return DataError(
                    f"{name} line {line}{column} is not UTF-8 text: {text[:80]!r}. Re-encode the file as UTF-8 "
                    "(e.g. `iconv -f latin1 -t utf-8`), or fix that value."
                )
            if not data:
                break
            line += data.count(b"\n")
            cut = data.rfind(b"\n")
            tail = tail + data if cut < 0 else data[cut + 1 :]
    return DataError(f"{name} is not UTF-8 text. Re-encode it as UTF-8.")


def _csv_column(fs, path: str, text: bytes, at: int) -> str:
    """ ", column 'c'": the CSV column holding byte `at` of `text`, a line of the CSV file; else ""."""
    if file_format(path) != "csv":
        return ""
    with _open_binary(fs, path) as f:
        first = f.read(1 << 16).split(b"\n", 1)[0]
    header = next(csv.reader([first.decode("utf-8-sig", errors="replace").rstrip("\r")]), [])
    # latin-1 keeps one character per byte, so a field's length is its length in the line (quotes aside).
    end = 0
    for i, value in enumerate(next(csv.reader([text.decode("latin-1")]), [])):
        end += len(value) + 1
        if at < end:
            return f", column {header[i]!r}" if i < len(header) else ""
    return ""


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
        elif (
            pa.types.is_string(t)
            or pa.types.is_large_string(t)
            or pa.types.is_temporal(t)
            or (pa.types.is_dictionary(t) and pa.types.is_string(t.value_type))
        ):
            target = pa.string()
        else:
            raise (_Binary if pa.types.is_binary(t) or pa.types.is_large_binary(t) else DataError)(
                f"Column {f.name!r} of {name} has type {t}, which elastic-step cannot train "
                f"on; convert it to one of {', '.join(TYPES)} (or drop it) first."
            )
        column = table.column(f.name)
        try:
            cols[f.name] = column if t == target else column.cast(target)
        except pa.ArrowInvalid as e:
            raise DataError(f"Column {f.name!r} of {name} does not fit {target}: {e}.") from None
    return pa.table(cols)


def _cast_declared(column: pa.ChunkedArray, declared: pa.DataType, c: str, name: str) -> pa.ChunkedArray:
    actual = column.type
    numeric = (pa.int64(), pa.float32(), pa.float64())
    if actual == declared or pa.types.is_null(actual) or (pa.types.is_floating(declared) and actual in numeric):
        return column.cast(declared)
    raise DataError(
        f"Column {c!r} of {name} holds {TYPE_NAMES.get(actual, actual)} values but the schema "
        f"declares {TYPE_NAMES[declared]}. Fix the schema or convert the column."
    )


def _check_columns(columns: list[str], declared: dict, name: str) -> None:
    missing = [c for c in declared if c not in columns]
    extra = [c for c in columns if c not in declared]
    if missing:
        raise DataError(
            f"Column {missing[0]!r} of the schema is missing from {name}. Fix the schema or "
            "the data so that they name the same columns."
        )
    if extra:
        raise DataError(
            f"{name} has column {extra[0]!r}, which the schema does not declare. Add it to "
            "the schema or remove it from the data."
        )


def combine(schemas: list[tuple[str, pa.Schema]], declared) -> pa.Schema:
    """The data set's schema from all files': the same columns everywhere, types widened int -> float only."""
    first_name, first = schemas[0]
    columns = list(declared) if declared is not None else first.names
    types = {c: first.field(c).type for c in columns} if declared is None else dict(declared)
    for name, s in schemas:
        if set(s.names) != set(columns):
            odd = sorted(set(s.names) ^ set(columns))[0]
            has, lacks = (name, first_name) if odd in s.names else (first_name, name)
            raise DataError(
                f"{has} has column {odd!r} but {lacks} does not; all source files need the "
                "same columns (or pass --schema to check them)."
            )
        if declared is None:
            for c in columns:
                types[c] = _widen(types[c], s.field(c).type, c, first_name, name)
    for c, t in types.items():
        if pa.types.is_null(t):  # never had a value anywhere
            types[c] = pa.string()
    return pa.schema([(c, types[c]) for c in columns])


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` with exactly `schema`'s columns: missing ones null, narrower types widened.

    Only the widenings `combine` and a JSON file's types allow reach here (null -> any, int ->
    float); an integer past 2**53 rounds to the nearest float64, as pyarrow's JSON reader does."""
    if table.schema.equals(schema):
        return table
    n = table.num_rows
    cols = []
    for f in schema:
        i = table.schema.get_field_index(f.name)
        if i < 0:
            cols.append(pa.nulls(n, f.type))
        else:
            col = table.column(i)
            cols.append(col if col.type == f.type else col.cast(f.type, safe=False))
    return pa.Table.from_arrays(cols, schema=schema)


def _widen(a: pa.DataType, b: pa.DataType, c: str, name_a: str, name_b: str) -> pa.DataType:
    if a == b or pa.types.is_null(b):
        return a
    if pa.types.is_null(a):
        return b
    numeric = (pa.int64(), pa.float32(), pa.float64())
    if a in numeric and b in numeric:
        return pa.float64()
    raise DataError(
        f"Column {c!r} is {TYPE_NAMES[a]} in {name_a} but {TYPE_NAMES[b]} in {name_b}. "
        "Pass --schema to declare its type."
    )
