"""Reading one source file a block at a time: the types and rows of a whole-file read, bad rows named."""

from __future__ import annotations

import json
import pathlib
import time

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq
import pytest

from elastic_step.data import parse
from elastic_step.errors import DataError

LOCAL = fsspec.filesystem("file")


def read(path: pathlib.Path, label=None, declared=None, skip=False):
    """(the file's table, its schema, how many times it restarted, its bad rows) as parse streams it."""
    bad = parse.BadRows(skip)
    source = parse.SourceFile(LOCAL, str(path), path.name, declared, label, bad)
    tables, restarts = [], 0
    for item in source.batches():
        if item is parse.RESTART:
            tables, restarts = [], restarts + 1
        else:
            tables.append(item)
    table = (
        pa.concat_tables([parse.conform(t, source.schema) for t in tables]) if tables else source.schema.empty_table()
    )
    return table, source.schema, restarts, bad


def same(a: pa.Table, b: pa.Table) -> bool:
    """The same columns, types and values, NaN equal to NaN."""
    return a.schema == b.schema and json.dumps(a.to_pylist()) == json.dumps(b.to_pylist())


def whole_file_csv(path: pathlib.Path) -> pa.Table:
    """pyarrow's whole-file read with prep's options, dates kept as text: what prep did before streaming."""
    options = parse._convert_options({})
    table = pa_csv.read_csv(path, parse_options=parse._CSV_PARSE, convert_options=options)
    temporal = {f.name: pa.string() for f in table.schema if pa.types.is_temporal(f.type)}
    if temporal:
        table = pa_csv.read_csv(path, parse_options=parse._CSV_PARSE, convert_options=parse._convert_options(temporal))
    return parse._supported(table, path.name)


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(parse, "CSV_BLOCK_BYTES", 1024)
    monkeypatch.setattr(parse, "CSV_CHUNK_BYTES", 1024)
    monkeypatch.setattr(parse, "JSON_CHUNK_BYTES", 1024)


LATE = {  # column: (the value of the first 3,000 rows, the value of the last row)
    "to_text": ("1", "x"),
    "to_float": ("1", "1.5"),
    "to_bool": ("0", "true"),
    "stays_int": ("0", "2"),
    "spaces": ("1", " 7 "),
    "plus": ("1", "+7"),
    "exponent": ("1", "1e3"),
    "inf": ("1", "inf"),
    "hex": ("1", "0x1F"),
    "too_big": ("1", "99999999999999999999"),
    "date_text": ("2024-01-02", "soon"),
    "time_date": ("12:30:00", "2024-01-02"),
    "nothing_then_int": ("", "5"),
    "bool_case": ("true", "True"),
}


def test_a_later_block_that_does_not_fit_the_first_blocks_types(tmp_path, small_blocks):
    # pyarrow's streaming reader infers types from the first block; its whole-file read loosens a type
    # that a later value does not fit. The file is read again with the whole-file types, not failed.
    path = tmp_path / "late.csv"
    names = list(LATE)
    path.write_text(
        ",".join(names)
        + "\n"
        + ",".join(LATE[c][0] for c in names)
        + "\n" * 1
        + (",".join(LATE[c][0] for c in names) + "\n") * 2999
        + ",".join(LATE[c][1] for c in names)
        + "\n"
    )
    table, schema, restarts, _ = read(path)
    assert restarts == 1
    expected = whole_file_csv(path)
    assert schema == expected.schema and same(table, expected)
    assert {f.name: str(f.type) for f in schema} == {
        "to_text": "string",
        "to_float": "double",
        "to_bool": "bool",
        "stays_int": "int64",
        "spaces": "int64",
        "plus": "double",
        "exponent": "double",
        "inf": "double",
        "hex": "int64",
        "too_big": "double",
        "date_text": "string",
        "time_date": "string",
        "nothing_then_int": "int64",
        "bool_case": "bool",
    }


@pytest.mark.parametrize(
    "values",
    [
        ["1", "-2", "3"],
        ["0", "1", "1"],
        ["1.5", "nan", "-inf"],
        ["True", "false", "1"],
        ["a", "1", ""],
        ["", ""],
        ["2024-01-01", "2024-02-30"],
        ["1", " 2", "3 "],
        ['"q"', "x,y", "multi\nline"],
        ["9223372036854775807", "-9223372036854775808"],
        ["9223372036854775808"],
        ["1_000"],
        ["1,5"],
    ],
)
def test_the_streamed_types_are_pyarrows_whole_file_types(tmp_path, small_blocks, values):
    # Each tricky value placed after 3,000 rows of "1", so the first block never sees it.
    def cell(v):
        return '"' + v.replace('"', '""') + '"' if any(ch in v for ch in ',"\n') else v

    path = tmp_path / "t.csv"
    path.write_text("v,w\n" + "1,1\n" * 3000 + "".join(f"{cell(v)},1\n" for v in values))
    table, schema, _, _ = read(path)
    expected = whole_file_csv(path)
    assert schema == expected.schema and same(table, expected)


@pytest.mark.parametrize(
    "layout",
    [
        "quote after chunks",
        "quoted newline across a chunk's end",
        "CRLF",
        "lone CR",
        "no newline at the end",
        "blank lines",
    ],
)
def test_chunks_cut_only_between_rows(tmp_path, small_blocks, layout):
    # Chunks are cut after an LF while the text has no quote; from there on it streams.
    rows = [f"{i},{i * 0.5},t{i % 7}" for i in range(3000)]
    if layout == "quote after chunks":
        rows[2500] = '2500,1.0,"a ""quoted"", text"'
    elif layout == "quoted newline across a chunk's end":
        rows[1500] = '1500,1.0,"' + "x" * 600 + "\n" + "y" * 600 + '"'
    text = "id,x,s\n" + "\n".join(rows) + "\n"
    if layout == "CRLF":
        text = text.replace("\n", "\r\n")
    elif layout == "lone CR":
        text = text[:20_000] + text[20_000:].replace("5\n", "5\r")  # mixed with LFs
    elif layout == "no newline at the end":
        text = text[:-1]
    elif layout == "blank lines":
        text = text.replace("\n1000,", "\n\n\n1000,")
    path = tmp_path / "c.csv"
    path.write_bytes(text.encode())
    table, schema, restarts, _ = read(path)
    assert restarts == 0
    expected = whole_file_csv(path)
    assert table.num_rows == 3000 and schema == expected.schema and same(table, expected)


def test_text_that_is_not_utf8_in_a_later_block(tmp_path, small_blocks):
    path = tmp_path / "bin.csv"
    path.write_bytes(b"s,n\n" + b"abc,1\n" * 3000 + b"\xff\xfe,1\n")
    with pytest.raises(DataError, match=r"bin\.csv line 3002, column 's' is not UTF-8 text: b'\\xff\\xfe,1'"):
        read(path)


def test_a_malformed_row_in_a_later_block_takes_the_precise_pass(tmp_path, small_blocks):
    path = tmp_path / "m.csv"
    path.write_text("a,label\n" + "".join(f"{i},{i % 2}\n" for i in range(3000)) + "7,1,9\n" + "8,0\n")
    with pytest.raises(DataError, match=r"m\.csv line 3002: it has 3 fields but the header has 2"):
        read(path, label="label")
    table, schema, restarts, bad = read(path, label="label", skip=True)
    assert restarts == 1 and bad.count == 1 and table.num_rows == 3001
    assert table.column("a").to_pylist() == list(range(3000)) + [8] and schema.field("a").type == pa.int64()


@pytest.mark.parametrize("suffix", ["csv", "jsonl"])
def test_a_label_gap_in_a_later_block_names_its_line(tmp_path, small_blocks, suffix):
    rows = [{"a": i, "label": i % 2} for i in range(3000)]
    rows[2500]["label"] = None
    path = tmp_path / f"gap.{suffix}"
    if suffix == "csv":
        path.write_text("a,label\n" + "".join(f"{r['a']},{'' if r['label'] is None else r['label']}\n" for r in rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = 2502 if suffix == "csv" else 2501
    with pytest.raises(DataError, match=rf"gap\.{suffix} line {line}, column 'label': the label is missing"):
        read(path, label="label")
    table, _, restarts, bad = read(path, label="label", skip=True)
    assert restarts == 1 and bad.count == 1 and bad.first[0]["line"] == line
    assert table.num_rows == 2999 and 2500 not in table.column("a").to_pylist()


def whole_file_json(path: pathlib.Path) -> pa.Table:
    """pyarrow's whole-file read, dates kept as text, as prep did before streaming."""
    table = pa_json.read_json(path)
    temporal = [(f.name, pa.string()) for f in table.schema if pa.types.is_temporal(f.type)]
    if temporal:
        table = pa_json.read_json(
            path,
            parse_options=pa_json.ParseOptions(explicit_schema=pa.schema(temporal), unexpected_field_behavior="infer"),
        )
    return parse._supported(table, path.name)


@pytest.mark.parametrize(
    "last",
    [
        {"a": 0.5, "n": 3, "d": "later", "s": "t", "new": True},  # d is text after all
        {"a": 1, "n": None, "d": "2024-03-04", "s": "t"},  # d a date throughout: read first, as before
    ],
)
def test_json_chunks_widen_as_a_whole_file_read_does(tmp_path, small_blocks, last):
    lines = [{"a": i, "n": None, "d": "2024-01-02", "s": f"s{i}"} for i in range(2000)] + [last]
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    table, schema, restarts, _ = read(path)
    assert restarts == 0
    expected = whole_file_json(path)
    assert schema == expected.schema and same(table, expected)


def test_a_json_key_that_changes_kind_later_takes_the_precise_pass(tmp_path, small_blocks):
    path = tmp_path / "k.jsonl"
    path.write_text(
        "".join(json.dumps({"a": i, "label": 1}) + "\n" for i in range(2000))
        + json.dumps({"a": "text", "label": 0})
        + "\n"
    )
    with pytest.raises(pa.ArrowInvalid):
        pa_json.read_json(path)  # the whole file too
    with pytest.raises(DataError, match=r"k\.jsonl line 2001, column 'a': cannot read \"text\" as int64"):
        read(path, label="label")
    table, _, restarts, bad = read(path, label="label", skip=True)
    assert restarts == 1 and bad.count == 1 and table.num_rows == 2000


def test_the_precise_pass_streams_its_rows(tmp_path, monkeypatch):
    # The precise pass yields batches as it goes (it infers types in a first read when it must).
    monkeypatch.setattr(parse, "PRECISE_BATCH_ROWS", 100)
    path = tmp_path / "p.csv"
    path.write_text("a,b\n" + "".join(f"{i},{i * 0.5}\n" for i in range(1000)) + "1,2,3\n")  # pyarrow rejects it
    bad = parse.BadRows(skip=True)
    source = parse.SourceFile(LOCAL, str(path), path.name, None, None, bad)
    items = list(source.batches())
    tables = items[items.index(parse.RESTART) + 1 :]
    assert [t.num_rows for t in tables] == [100] * 10 and bad.count == 1
    assert source.schema == pa.schema([("a", pa.int64()), ("b", pa.float64())])


def test_an_empty_json_lines_file_reads_as_before(tmp_path):
    path = tmp_path / "e.jsonl"
    path.write_text("")
    table, schema, _, _ = read(path)
    assert table.num_rows == 0 and schema.names == []


def most_arrow_memory(source: parse.SourceFile, pause_s: float = 0.0) -> tuple[int, int]:
    """(rows, the most bytes Arrow held) while the file is read, a consumer pausing after each batch."""
    rows = most = 0
    for item in source.batches():
        rows = 0 if item is parse.RESTART else rows + item.num_rows
        most = max(most, pa.total_allocated_bytes())
        time.sleep(pause_s)
    return rows, most


def test_a_slow_reader_of_a_csv_file_does_not_make_it_buffer(tmp_path):
    # pyarrow's dataset scanner keeps parsing ahead of a slower reader, without bound; open_csv does not.
    path = tmp_path / "big.csv"
    n = 3_000_000
    pa_csv.write_csv(pa.table({"a": np.arange(n), "b": np.arange(n) * 0.5, "c": np.arange(n) % 100}), path)  # 60 MB
    before = pa.total_allocated_bytes()
    rows, most = most_arrow_memory(
        parse.SourceFile(LOCAL, str(path), path.name, None, None, parse.BadRows(False)), pause_s=0.02
    )
    assert rows == n and most - before < 25e6, most - before  # 72 MB as Arrow columns


def test_a_parquet_file_is_read_a_batch_at_a_time(tmp_path):
    # ParquetFile's default pre_buffer reads every row group ahead: the whole file.
    path = tmp_path / "big.parquet"
    n = 2_000_000
    pq.write_table(
        pa.table({"a": np.arange(n), "b": np.arange(n) * 0.5, "c": np.arange(n) % 7}),
        path,
        row_group_size=250_000,
        compression="none",
    )  # 48 MB in 8 row groups
    before = pa.total_allocated_bytes()
    rows, most = most_arrow_memory(parse.SourceFile(LOCAL, str(path), path.name, None, None, parse.BadRows(False)))
    assert rows == n and most - before < 25e6, most - before
