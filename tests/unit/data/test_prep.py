"""Data prep: formats in, manifests and shards out, bad rows, schemas, errors and atomic output."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic_step.data import prep as prep_module
from elastic_step.data.manifest import load_manifest
from elastic_step.data.prep import MAX_BAD_ROWS, prepare
from elastic_step.errors import ConfigError, DataError

ROOT = pathlib.Path(__file__).resolve().parents[3]
DIGITS = ROOT / "samples" / "digits" / "digits.csv"


def write(path: pathlib.Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def rows_of(manifest) -> list[dict]:
    """Every record of a manifest's shards, in shard order."""
    out = []
    for shard in manifest.shards:
        with fsspec.open(manifest.shard_uri(shard), "rb") as f:
            out += pq.read_table(f).to_pylist()
    return out


def key(row: dict) -> tuple:
    return tuple(sorted(row.items()))


CSV = "id,x,name,label\n" + "".join(f"{i},{i * 0.5},n{i},{i % 2}\n" for i in range(40))


# ---------------------------------------------------------------- formats in, manifests out


def test_csv_rows_schema_and_manifest(tmp_path):
    src = write(tmp_path / "data.csv", CSV)
    r = prepare(src, str(tmp_path / "out"), label="label", eval_fraction=0.25, shard_rows=7, row_group_rows=3)
    assert (r.train.total_rows, r.eval.total_rows) == (30, 10)
    assert [(f.name, f.type) for f in r.train.schema] == [
        ("id", "int64"),
        ("x", "float64"),
        ("name", "string"),
        ("label", "int64"),
    ]
    assert [s.path for s in r.train.shards] == [f"part-{i:05d}.parquet" for i in range(5)]
    assert [s.rows for s in r.train.shards] == [7, 7, 7, 7, 2]
    # Row counts in the manifest are the rows in the shards; together they are the source, once each.
    for m in (r.train, r.eval):
        for shard in m.shards:
            md = pq.ParquetFile(m.shard_uri(shard)).metadata
            assert md.num_rows == shard.rows
            assert max(md.row_group(i).num_rows for i in range(md.num_row_groups)) <= 3
    got = sorted(key(row) for row in rows_of(r.train) + rows_of(r.eval))
    assert got == sorted(key({"id": i, "x": i * 0.5, "name": f"n{i}", "label": i % 2}) for i in range(40))
    # What was written is what load_manifest reads back, and the result points at it.
    assert r.train_uri == str(tmp_path / "out" / "train" / "manifest.json")
    loaded = load_manifest(str(tmp_path / "out" / "eval"))
    assert (loaded.split, loaded.label, loaded.total_rows, loaded.source) == ("eval", "label", 10, src)
    assert loaded.shards == r.eval.shards and loaded.schema == r.eval.schema
    assert sorted(os.listdir(tmp_path / "out")) == ["eval", "train"]  # no temporary folders left


def test_digits_sample(tmp_path):
    r = prepare(str(DIGITS), str(tmp_path / "digits"), label="label")
    assert (r.train.total_rows, r.eval.total_rows) == (1438, 359)
    assert len(r.train.schema) == 65 and {f.type for f in r.train.schema} == {"int64"}


def test_jsonl_in(tmp_path):
    lines = [json.dumps({"a": i, "b": f"s{i}", "ok": i % 3 == 0, "when": f"2024-01-0{i % 9 + 1}"}) for i in range(20)]
    src = write(tmp_path / "d.jsonl", "\n".join(lines[:10]) + "\n\n" + "\n".join(lines[10:]) + "\n")
    r = prepare(src, str(tmp_path / "out"), label="ok")
    types = {f.name: f.type for f in r.train.schema}
    assert types == {"a": "int64", "b": "string", "ok": "bool", "when": "string"}  # dates kept as text
    got = sorted(key(row) for row in rows_of(r.train) + rows_of(r.eval))
    assert got == sorted(key(json.loads(line)) for line in lines)


def test_parquet_in_with_narrow_types(tmp_path):
    table = pa.table(
        {
            "a": pa.array(range(30), pa.int32()),
            "f": pa.array([0.5] * 30, pa.float32()),
            "c": pa.array(["x", "y", "z"] * 10).dictionary_encode(),
            "label": pa.array([1, 0] * 15, pa.int8()),
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    r = prepare(str(tmp_path / "d.parquet"), str(tmp_path / "out"), label="label")
    assert [(f.name, f.type) for f in r.train.schema] == [
        ("a", "int64"),
        ("f", "float32"),
        ("c", "string"),
        ("label", "int64"),
    ]
    assert r.train.total_rows + r.eval.total_rows == 30


def test_folder_and_glob_of_mixed_files(tmp_path):
    (tmp_path / "in").mkdir()
    write(tmp_path / "in" / "a.csv", "k,v\n1,2\n3,4\n5,6\n")
    write(tmp_path / "in" / "b.jsonl", '{"v": 0.5, "k": 7}\n{"k": 8, "v": 1}\n')
    pq.write_table(pa.table({"k": [9, 10], "v": [11, 12]}), tmp_path / "in" / "c.pq")
    write(tmp_path / "in" / "_SUCCESS", "")
    write(tmp_path / "in" / "notes.txt", "not data")
    r = prepare(str(tmp_path / "in"), str(tmp_path / "out"), label="k")
    assert {f.name: f.type for f in r.train.schema} == {"k": "int64", "v": "float64"}  # int and float -> float
    assert sorted(row["k"] for row in rows_of(r.train) + rows_of(r.eval)) == [1, 3, 5, 7, 8, 9, 10]
    r = prepare(str(tmp_path / "in" / "*.csv"), str(tmp_path / "out2"))
    assert r.train.total_rows + r.eval.total_rows == 3 and r.train.label is None


def test_fsspec_uris_in_and_out():
    # memory:// stands in for gs:// and s3://: a filesystem without rename.
    fs = fsspec.filesystem("memory")
    fs.pipe("/prep-test/in/d.csv", CSV.encode())
    try:
        r = prepare("memory://prep-test/in/d.csv", "memory://prep-test/out", label="label", shard_rows=10)
        assert r.train_uri == "memory://prep-test/out/train/manifest.json"
        assert load_manifest(r.train_uri).total_rows == 32 == len(rows_of(r.train))
        # A second, smaller run leaves no stale shard next to the new manifest.
        r = prepare("memory://prep-test/in/d.csv", "memory://prep-test/out", label="label", shard_rows=100)
        assert sorted(os.path.basename(p) for p in fs.ls("/prep-test/out/train", detail=False)) == [
            "manifest.json",
            "part-00000.parquet",
        ]
    finally:
        fs.rm("/prep-test", recursive=True)


def test_split_is_deterministic_by_seed(tmp_path):
    src = write(tmp_path / "d.csv", CSV)
    a = prepare(src, str(tmp_path / "a"), seed=7, shard_rows=9)
    b = prepare(src, str(tmp_path / "b"), seed=7, shard_rows=9)
    c = prepare(src, str(tmp_path / "c"), seed=8, shard_rows=9)
    for split in ("train", "eval"):
        for shard in getattr(a, split).shards:
            ta = pq.read_table(tmp_path / "a" / split / shard.path)
            assert ta.equals(pq.read_table(tmp_path / "b" / split / shard.path))
    assert [r["id"] for r in rows_of(a.eval)] == [r["id"] for r in rows_of(b.eval)]
    assert [r["id"] for r in rows_of(a.eval)] != [r["id"] for r in rows_of(c.eval)]


# ---------------------------------------------------------------- bad rows

BAD_CSV = (
    "a,b,label\n"  # line 1
    "1,2.5,0\n"  # 2
    "\n"  # 3: blank, not a row
    '2,"multi\n'  # 4: a quoted value over two lines
    'line",1\n'  # 5
    "3,4.5\n"  # 6: a field short
    "4,oops,1\n"  # 7: not a float
    "5,6.5,\n"  # 8: no label
    "6,7.5,1,9\n"  # 9: a field too many
    "7,8.5,0\n"
)  # 10

SCHEMA = {
    "fields": [{"name": "a", "type": "int64"}, {"name": "b", "type": "float64"}, {"name": "label", "type": "int64"}]
}


@pytest.fixture
def schema_file(tmp_path):
    return write(tmp_path / "schema.json", json.dumps(SCHEMA))


def test_bad_row_error_names_file_line_and_column(tmp_path, schema_file):
    src = write(tmp_path / "bad.csv", BAD_CSV)
    with pytest.raises(DataError) as e:
        prepare(src, str(tmp_path / "out"), label="label", schema=schema_file)
    msg = str(e.value)
    assert src in msg and "line 4" in msg and "'b'" in msg and "float64" in msg and "skip" in msg
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "text, line, column, reason",
    [
        ("a,b,label\n1,2,0\n3,4\n", 3, "label", "2 fields but the header has 3"),
        ("a,b,label\n1,2,0\n\n3,4,1,5\n", 4, None, "4 fields but the header has 3"),
        ("a,b,label\n1,2,0\n3,4,\n", 3, "label", "the label is missing"),
        ("a,b,label\n1,2,0\n3,x,1\n", 3, "b", "cannot read 'x' as float64"),
    ],
)
def test_each_kind_of_bad_row(tmp_path, schema_file, text, line, column, reason):
    src = write(tmp_path / "bad.csv", text)
    with pytest.raises(DataError) as e:
        prepare(src, str(tmp_path / "out"), label="label", schema=schema_file)
    msg = str(e.value)
    assert f"{src} line {line}" in msg and reason in msg
    assert (f"column {column!r}" in msg) if column else ("column" not in msg.split(":")[0])


def test_missing_label_is_found_without_a_schema(tmp_path):
    src = write(tmp_path / "bad.csv", "a,label\n1,0\n2,1\n3,\n4,1\n")
    with pytest.raises(DataError, match=r"bad\.csv line 4, column 'label': the label is missing"):
        prepare(src, str(tmp_path / "out"), label="label")


def test_skip_counts_bad_rows(tmp_path, schema_file):
    src = write(tmp_path / "bad.csv", BAD_CSV)
    r = prepare(src, str(tmp_path / "out"), label="label", schema=schema_file, on_bad_rows="skip")
    assert r.train.skipped_rows == r.eval.skipped_rows == 5
    assert [(b["line"], b["column"]) for b in r.train.bad_rows] == [
        (4, "b"),
        (6, "label"),
        (7, "b"),
        (8, "label"),
        (9, None),
    ]
    assert all(b["file"] == src and b["reason"] for b in r.train.bad_rows)
    assert sorted(row["a"] for row in rows_of(r.train) + rows_of(r.eval)) == [1, 7]
    assert load_manifest(r.train_uri).bad_rows == r.train.bad_rows


def test_skip_keeps_only_the_first_bad_rows(tmp_path):
    text = "a,label\n" + "".join(f"{i},{'' if i % 2 else 1}\n" for i in range(100))
    r = prepare(write(tmp_path / "d.csv", text), str(tmp_path / "out"), label="label", on_bad_rows="skip")
    assert r.train.skipped_rows == 50 and len(r.train.bad_rows) == MAX_BAD_ROWS
    assert r.train.bad_rows[0]["line"] == 3 and r.train.total_rows + r.eval.total_rows == 50


def test_jsonl_bad_rows(tmp_path):
    src = write(
        tmp_path / "d.jsonl",
        '{"a": 1, "label": 0}\n{"a": 2, "label": 1}\n{"a": 3,\n'
        '{"a": "x", "label": 1}\n{"a": 5}\n{"a": 6, "label": 1}\n',
    )
    with pytest.raises(DataError, match=r"d\.jsonl line 3: it is not valid JSON"):
        prepare(src, str(tmp_path / "out"), label="label")
    r = prepare(src, str(tmp_path / "out"), label="label", on_bad_rows="skip")
    assert [(b["line"], b["column"]) for b in r.train.bad_rows] == [(3, None), (4, "a"), (5, "label")]
    assert sorted(row["a"] for row in rows_of(r.train) + rows_of(r.eval)) == [1, 2, 6]


def test_parquet_missing_label_names_the_row(tmp_path):
    pq.write_table(pa.table({"a": [1, 2, 3], "label": [0, None, 1]}), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet row 2, column 'label': the label is missing"):
        prepare(str(tmp_path / "d.parquet"), str(tmp_path / "out"), label="label")


def test_all_rows_bad_is_an_error_even_when_skipping(tmp_path, schema_file):
    src = write(tmp_path / "d.csv", "a,b,label\n1,x,0\n2,y,1\n")
    with pytest.raises(DataError, match=r"Every row of .*d\.csv is bad"):
        prepare(src, str(tmp_path / "out"), label="label", schema=schema_file, on_bad_rows="skip")


# ---------------------------------------------------------------- schema


@pytest.mark.parametrize(
    "text, column",
    [
        ("a,label\n1,0\n2,1\n", "'b'"),  # missing column
        ("a,b,label,extra\n1,2,0,9\n2,3,1,9\n", "'extra'"),  # extra column
    ],
)
def test_csv_schema_mismatch_names_column_and_file(tmp_path, schema_file, text, column):
    src = write(tmp_path / "d.csv", text)
    with pytest.raises(DataError) as e:
        prepare(src, str(tmp_path / "out"), label="label", schema=schema_file, on_bad_rows="skip")
    assert column in str(e.value) and src in str(e.value) and "schema" in str(e.value)


def test_parquet_wrong_type_is_a_schema_mismatch(tmp_path, schema_file):
    pq.write_table(pa.table({"a": [1.5, 2.5], "b": [1.0, 2.0], "label": [0, 1]}), tmp_path / "d.parquet")
    with pytest.raises(
        DataError,
        match=r"Column 'a' of .*d\.parquet holds float64 values but the schema "
        r"declares int64",
    ):
        prepare(str(tmp_path / "d.parquet"), str(tmp_path / "out"), label="label", schema=schema_file)


def test_jsonl_schema_mismatch(tmp_path, schema_file):
    src = write(tmp_path / "d.jsonl", '{"a": 1, "b": 2.0, "label": 0, "zz": 1}\n')
    with pytest.raises(DataError, match=r"'zz'.*schema does not declare"):
        prepare(src, str(tmp_path / "out"), label="label", schema=schema_file)
    src = write(tmp_path / "d.jsonl", '{"a": 1, "label": 0}\n{"a": 2, "label": 1}\n')
    with pytest.raises(DataError, match=r"Column 'b' of the schema has no value in .*d\.jsonl"):
        prepare(src, str(tmp_path / "out"), label="label", schema=schema_file)


def test_schema_types_are_applied(tmp_path):
    schema = write(
        tmp_path / "s.json",
        json.dumps(
            {
                "fields": [
                    {"name": "a", "type": "float32"},
                    {"name": "s", "type": "string"},
                    {"name": "t", "type": "bool"},
                ]
            }
        ),
    )
    src = write(tmp_path / "d.csv", "a,s,t\n1,007,true\n2,008,false\n3,009,true\n")
    r = prepare(src, str(tmp_path / "out"), schema=schema)
    assert [f.type for f in r.train.schema] == ["float32", "string", "bool"]
    assert sorted(row["s"] for row in rows_of(r.train) + rows_of(r.eval)) == ["007", "008", "009"]


def test_label_must_be_in_the_schema(tmp_path, schema_file):
    src = write(tmp_path / "d.csv", CSV)
    with pytest.raises(DataError, match="label column 'nope'"):
        prepare(src, str(tmp_path / "out"), label="nope")
    with pytest.raises(DataError, match="label column 'nope'"):
        prepare(src, str(tmp_path / "out"), label="nope", schema=schema_file)


@pytest.mark.parametrize(
    "content, match",
    [
        ("not json", "Cannot read the schema file"),
        ('{"fields": []}', "non-empty"),
        ('{"fields": [{"name": "a", "type": "int32"}]}', "type 'int32'"),
        ('{"fields": [{"name": "a", "type": "int64"}, {"name": "a", "type": "bool"}]}', "twice"),
    ],
)
def test_bad_schema_file(tmp_path, content, match):
    schema = write(tmp_path / "s.json", content)
    with pytest.raises(ConfigError, match=match):
        prepare(write(tmp_path / "d.csv", CSV), str(tmp_path / "out"), schema=schema)


# ---------------------------------------------------------------- errors and parameters


@pytest.mark.parametrize("source", ["{tmp}/does-not-exist.csv", "nosuchprotocol://bucket/d.csv", "{tmp}/empty-folder"])
def test_unreadable_source_names_the_uri(tmp_path, source):
    (tmp_path / "empty-folder").mkdir()
    source = source.format(tmp=tmp_path)
    with pytest.raises(DataError) as e:
        prepare(source, str(tmp_path / "out"))
    assert source in str(e.value) and ("Check" in str(e.value) or "must end in" in str(e.value))


def test_unknown_extension(tmp_path):
    src = write(tmp_path / "d.txt", CSV)
    with pytest.raises(DataError, match=r"d\.txt.*must end in \.csv"):
        prepare(src, str(tmp_path / "out"))


def test_not_a_parquet_file(tmp_path):
    src = write(tmp_path / "d.parquet", CSV)
    with pytest.raises(DataError, match=r"d\.parquet is not a readable Parquet file"):
        prepare(src, str(tmp_path / "out"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"eval_fraction": 0}, "eval_fraction"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
        ({"eval_fraction": -0.1}, "eval_fraction"),
        ({"shard_rows": 0}, "shard_rows"),
        ({"row_group_rows": -1}, "row_group_rows"),
        ({"on_bad_rows": "ignore"}, "on_bad_rows"),
        ({"seed": 1.5}, "seed"),
        ({"label": ""}, "label"),
    ],
)
def test_parameters_are_checked(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        prepare(write(tmp_path / "d.csv", CSV), str(tmp_path / "out"), **kwargs)


def test_output_inside_the_source_folder_is_refused(tmp_path):
    (tmp_path / "in").mkdir()
    write(tmp_path / "in" / "d.csv", CSV)
    with pytest.raises(ConfigError, match="inside the source"):
        prepare(str(tmp_path / "in"), str(tmp_path / "in" / "prepared"))


def test_a_folder_holding_other_files_is_not_replaced(tmp_path):
    (tmp_path / "home").mkdir()
    write(tmp_path / "home" / "precious.txt", "keep me")
    with pytest.raises(ConfigError, match="new or empty folder"):
        prepare(write(tmp_path / "d.csv", CSV), str(tmp_path / "home"))
    assert (tmp_path / "home" / "precious.txt").read_text() == "keep me"


# ---------------------------------------------------------------- nothing half-written looks valid


def snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_failed_run_leaves_the_previous_output_intact(tmp_path, schema_file):
    out = tmp_path / "out"
    prepare(write(tmp_path / "good.csv", CSV), str(out), label="label")
    before = snapshot(out)
    with pytest.raises(DataError):
        prepare(write(tmp_path / "bad.csv", BAD_CSV), str(out), label="label", schema=schema_file)
    assert snapshot(out) == before
    assert os.listdir(tmp_path) and not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_crash_while_writing_shards_leaves_nothing_that_looks_valid(tmp_path, monkeypatch):
    real = pq.write_table
    calls = []

    def failing_write(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(prep_module.pq, "write_table", failing_write)
    src = write(tmp_path / "d.csv", CSV)
    with pytest.raises(OSError, match="disk full"):
        prepare(src, str(tmp_path / "fresh"), shard_rows=5)
    assert not (tmp_path / "fresh").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]

    monkeypatch.setattr(prep_module.pq, "write_table", real)
    prepare(src, str(tmp_path / "kept"), shard_rows=50)
    before = snapshot(tmp_path / "kept")
    calls.clear()
    monkeypatch.setattr(prep_module.pq, "write_table", failing_write)
    with pytest.raises(OSError):
        prepare(src, str(tmp_path / "kept"), shard_rows=5)
    assert snapshot(tmp_path / "kept") == before


def test_remote_crash_leaves_no_manifest(monkeypatch):
    fs = fsspec.filesystem("memory")
    fs.pipe("/prep-crash/d.csv", CSV.encode())
    try:
        prepare("memory://prep-crash/d.csv", "memory://prep-crash/out")
        assert fs.exists("/prep-crash/out/train/manifest.json")

        def failing_write(*args, **kwargs):
            raise OSError("connection reset")

        monkeypatch.setattr(prep_module.pq, "write_table", failing_write)
        with pytest.raises(OSError):
            prepare("memory://prep-crash/d.csv", "memory://prep-crash/out")
        # The old manifests went first, so none points at a half-written shard.
        assert not fs.exists("/prep-crash/out/train/manifest.json")
        assert not fs.exists("/prep-crash/out/eval/manifest.json")
    finally:
        fs.rm("/prep-crash", recursive=True)


# ---------------------------------------------------------------- streaming: order, sizes, memory


def output_bytes(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_different_seed_different_order(tmp_path):
    src = write(tmp_path / "d.csv", "id,x\n" + "".join(f"{i},{i * 0.5}\n" for i in range(5000)))
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        prepare(src, str(tmp_path / name), seed=seed, shard_rows=700, row_group_rows=100)
    assert output_bytes(tmp_path / "a") == output_bytes(tmp_path / "b")
    ids = {
        n: {split: [r["id"] for r in rows_of(load_manifest(str(tmp_path / n / split)))] for split in ("train", "eval")}
        for n in "ac"
    }
    a, c = ids["a"], ids["c"]
    assert sorted(a["train"] + a["eval"]) == sorted(c["train"] + c["eval"]) == list(range(5000))
    assert (len(a["eval"]), len(a["train"])) == (len(c["eval"]), len(c["train"])) == (1000, 4000)
    assert len(set(a["eval"]) & set(c["eval"])) < 300  # other rows (~200 alike by chance), in other orders
    assert sum(x == y for x, y in zip(a["train"], c["train"])) < 20


@pytest.mark.parametrize("n", [2, 3, 7, 100, 1001])
@pytest.mark.parametrize("fraction", [0.01, 0.2, 0.5, 0.99])
def test_split_sizes_are_exact(tmp_path, n, fraction):
    src = write(tmp_path / "d.csv", "id\n" + "".join(f"{i}\n" for i in range(n)))
    r = prepare(src, str(tmp_path / "out"), eval_fraction=fraction, shard_rows=30)
    n_eval = min(max(round(n * fraction), 1), n - 1)
    assert (r.eval.total_rows, r.train.total_rows) == (n_eval, n - n_eval)
    assert sorted(row["id"] for row in rows_of(r.train) + rows_of(r.eval)) == list(range(n))


def test_a_shard_too_big_for_memory_streams_to_its_file_with_the_same_bytes(tmp_path, monkeypatch):
    src = write(tmp_path / "d.csv", "id,s\n" + "".join(f"{i},{'v' * (i % 50)}\n" for i in range(4000)))
    prepare(src, str(tmp_path / "whole"), shard_rows=1500, row_group_rows=128)
    streamed = []
    real = prep_module._ShardWriter._stream
    monkeypatch.setattr(prep_module._ShardWriter, "_stream", lambda self: streamed.append(1) or real(self))
    monkeypatch.setattr(prep_module, "SHARD_BUFFER_BYTES", 5000)
    prepare(src, str(tmp_path / "streamed"), shard_rows=1500, row_group_rows=128)
    assert streamed
    assert output_bytes(tmp_path / "streamed") == output_bytes(tmp_path / "whole")


def test_dictionary_pages_only_where_values_repeat(tmp_path):
    src = write(
        tmp_path / "d.csv", "id,x,cat,label\n" + "".join(f"{i},{i * 0.37},c{i % 5},{i % 2}\n" for i in range(5000))
    )
    r = prepare(src, str(tmp_path / "out"), label="label", shard_rows=5000)
    md = pq.ParquetFile(r.train.shard_uri(r.train.shards[0])).metadata
    dictionary = {
        md.schema.column(i).name: "PLAIN_DICTIONARY" in md.row_group(0).column(i).encodings
        or "RLE_DICTIONARY" in md.row_group(0).column(i).encodings
        for i in range(md.num_columns)
    }
    assert dictionary == {"id": False, "x": False, "cat": True, "label": True}


# Peak RSS of the whole prep (one file: one process), imports (80 MB) included: measured 280-290 MB with
# 32 MB sort units and spill buffers (shuffle.py) and 6 CSV chunks parsed ahead (parse.py); flat with size.
BOUND_MB = 400
SOURCE_MB = 1250  # three times the bound as CSV text; more in memory (~1.3 GB as Arrow columns)


def test_a_source_larger_than_memory_is_prepared_in_bounded_memory(tmp_path):
    # The old prep held the whole table (and a shuffled copy): ~4x the source's size in RSS.
    from bench.prep import make_source

    rows, size = make_source(tmp_path / "src", SOURCE_MB, 0)
    assert size > 3 * BOUND_MB * 1e6
    # VmHWM, not getrusage's ru_maxrss: Linux carries the latter over exec from the forked copy of the
    # parent, so a child of a big pytest process reports the parent's size (922 MB seen in a full run).
    code = (
        "import json, sys\n"
        "from elastic_step.data.prep import prepare\n"
        "r = prepare(sys.argv[1], sys.argv[2], label='label')\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]\n"
        "print(json.dumps({'train': r.train.total_rows, 'eval': r.eval.total_rows, 'peak_mb': int(hwm) / 1024}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "src"), str(tmp_path / "out")],
        cwd=ROOT,
        env=dict(os.environ, TMPDIR=str(tmp_path)),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["peak_mb"] < BOUND_MB, got
    assert got["train"] + got["eval"] == rows
    ids = []
    for split in ("train", "eval"):
        m = load_manifest(str(tmp_path / "out" / split))
        ids += [pq.read_table(m.shard_uri(s), columns=["id"]).column("id").to_numpy() for s in m.shards]
    assert np.array_equal(np.sort(np.concatenate(ids)), np.arange(rows))  # every source row, once
    assert not [p for p in os.listdir(tmp_path) if p.startswith("elastic-step-prep-")]  # spills removed


def test_a_weight_column_is_recorded_in_both_manifests_and_checked(tmp_path):
    src = write(tmp_path / "w.csv", "x,label,w,name\n" + "".join(f"{i},{i % 2},{i / 4},n{i}\n" for i in range(20)))
    r = prepare(src, str(tmp_path / "out"), label="label", weight_column="w")
    assert r.train.weight_column == r.eval.weight_column == "w"
    assert load_manifest(r.train_uri).weight_column == load_manifest(r.eval_uri).weight_column == "w"
    assert load_manifest(prepare(src, str(tmp_path / "plain"), label="label").train_uri).weight_column is None
    with pytest.raises(DataError, match="weight column 'weight' is not in the data .* Pass --weight-column"):
        prepare(src, str(tmp_path / "o2"), label="label", weight_column="weight")
    with pytest.raises(DataError, match="weight column 'name' holds string values: sample weights are numbers"):
        prepare(src, str(tmp_path / "o3"), label="label", weight_column="name")
    with pytest.raises(ConfigError, match="weight column 'label' is the label"):
        prepare(src, str(tmp_path / "o4"), label="label", weight_column="label")


# ---------------------------------------------------------------- NaN, infinite and empty numeric cells

# Rows 2, 4, 6 (lines 4, 6, 8, the header being line 1) hold an empty, a NaN and an infinite cell.
NON_FINITE_CSV = "id,x,y,name,label\n" + "".join(
    f"{i},{'' if i == 2 else 'nan' if i == 4 else i * 0.5},{'-inf' if i == 6 else i},{'' if i == 3 else 'n'},{i % 2}\n"
    for i in range(20)
)


def test_non_finite_cells_are_refused_with_each_columns_counts_and_first_lines(tmp_path):
    src = write(tmp_path / "d.csv", NON_FINITE_CSV)
    with pytest.raises(DataError) as e:
        prepare(src, str(tmp_path / "out"), label="label")
    text = str(e.value)
    assert "column 'x': 1 NaN, 1 empty (first at " + src + " lines 4, 6)" in text
    assert "column 'y': 1 infinite (first at " + src + " line 8)" in text
    assert "'name'" not in text  # an empty text cell is a value, not a number that is missing
    assert "--non-finite drop" in text and "--non-finite zero" in text
    assert not (tmp_path / "out").exists()


def test_the_precise_pass_names_the_lines_past_the_bad_rows_it_skips(tmp_path):
    # A malformed row (line 3) takes the precise pass; skipped, it must not shift the lines named after it.
    src = write(tmp_path / "d.csv", "x,label\n1,0\n2,1,7\n\n3,1\nnan,0\n5,1\n")
    with pytest.raises(DataError, match=r"column 'x': 1 NaN \(first at .*d\.csv line 6\)"):
        prepare(src, str(tmp_path / "out"), label="label", on_bad_rows="skip")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_non_finite_cells_in_json_lines_and_parquet(tmp_path, fmt):
    x = [0.5, None, 1.5, float("inf"), 2.0]
    if fmt == "jsonl":
        src = write(tmp_path / "d.jsonl", "".join(json.dumps({"x": v, "label": 1}) + "\n" for v in x))
        where = "lines 2, 4"
    else:
        src = str(tmp_path / "d.parquet")
        pq.write_table(pa.table({"x": x, "label": [1] * 5}), src)
        where = "rows 2, 4"
    with pytest.raises(DataError, match=rf"column 'x': 1 infinite, 1 empty \(first at .*d\.{fmt} {where}\)"):
        prepare(src, str(tmp_path / "out"), label="label")


def test_non_finite_drop_and_zero(tmp_path):
    src = write(tmp_path / "d.csv", NON_FINITE_CSV)
    dropped = prepare(src, str(tmp_path / "drop"), label="label", non_finite="drop")
    rows = rows_of(dropped.train) + rows_of(dropped.eval)
    assert sorted(r["id"] for r in rows) == [i for i in range(20) if i not in (2, 4, 6)]
    assert dropped.train.non_finite["policy"] == "drop" and dropped.train.non_finite["rows"] == 3
    assert dropped.train.non_finite["columns"]["x"] == {
        "nan": 1,
        "inf": 0,
        "empty": 1,
        "first": [{"file": src, "line": 4}, {"file": src, "line": 6}],
    }
    assert load_manifest(dropped.train_uri).non_finite == dropped.train.non_finite
    zeroed = prepare(src, str(tmp_path / "zero"), label="label", non_finite="zero")
    rows = {r["id"]: r for r in rows_of(zeroed.train) + rows_of(zeroed.eval)}
    assert sorted(rows) == list(range(20)) and zeroed.train.non_finite["rows"] == 3
    assert (rows[2]["x"], rows[4]["x"], rows[6]["y"], rows[5]["x"], rows[3]["name"]) == (0.0, 0.0, 0.0, 2.5, None)
    assert json.loads(pathlib.Path(zeroed.train_uri).read_text())["non_finite"]["policy"] == "zero"


def test_non_finite_must_be_a_known_choice(tmp_path):
    with pytest.raises(ConfigError, match=r"non_finite must be one of 'fail', 'drop', 'zero', got 'skip'"):
        prepare(write(tmp_path / "d.csv", CSV), str(tmp_path / "out"), non_finite="skip")


def test_text_that_is_not_utf8_names_its_line_and_column(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes(b"id,text,label\n1,plain,0\n2,caf\xe9,1\n3,more,0\n")
    with pytest.raises(DataError, match=r"latin1\.csv line 3, column 'text' is not UTF-8 text: b'2,caf\\xe9,1'"):
        prepare(str(path), str(tmp_path / "out"), label="label")


# ---------------------------------------------------------------- the label's summary, per split


def test_each_split_records_its_labels_range_and_distinct_count(tmp_path):
    src = write(tmp_path / "d.csv", "x,label,score\n" + "".join(f"{i},{i % 7 - 2},{i / 4}\n" for i in range(200)))
    result = prepare(src, str(tmp_path / "out"), label="label", eval_fraction=0.5, shard_rows=16)
    for m in (result.train, result.eval):
        labels = [r["label"] for r in rows_of(m)]
        expected = {"type": "int64", "min": min(labels), "max": max(labels), "distinct": len(set(labels))}
        assert m.label_summary == expected
        assert load_manifest(m.uri).label_summary == expected
    scored = prepare(src, str(tmp_path / "score"), label="score")
    scores = [r["score"] for r in rows_of(scored.train)]
    assert scored.train.label_summary == {"type": "float64", "min": min(scores), "max": max(scores)}  # no count


def test_many_distinct_labels_are_not_counted_and_no_label_has_no_summary(tmp_path):
    n = prep_module.MAX_DISTINCT_LABELS * 3
    src = write(tmp_path / "d.csv", "x,label\n" + "".join(f"{i},{i}\n" for i in range(n)))
    train = prepare(src, str(tmp_path / "out"), label="label").train
    assert set(train.label_summary) == {"type", "min", "max"}
    assert prepare(src, str(tmp_path / "none"), label=None).train.label_summary == {}


def test_non_finite_zero_sets_a_nan_label_to_0_and_its_summary_says_so(tmp_path):
    src = write(tmp_path / "d.csv", "x,label\n" + "".join(f"{i},{'nan' if i == 3 else 2.0}\n" for i in range(10)))
    result = prepare(src, str(tmp_path / "out"), label="label", non_finite="zero")
    rows = {r["x"]: r["label"] for r in rows_of(result.train) + rows_of(result.eval)}
    assert rows[3] == 0.0 and {v for x, v in rows.items() if x != 3} == {2.0}
    assert result.train.non_finite["columns"]["label"]["nan"] == 1
    split = result.train if any(r["x"] == 3 for r in rows_of(result.train)) else result.eval
    assert split.label_summary == {"type": "float64", "min": 0.0, "max": 2.0}
