"""The seeded shuffle: keys, buckets and the two passes, run serially and in a process pool."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic_step.data import parse, prep, shuffle
from elastic_step.data.prep import prepare
from elastic_step.errors import DataError

MASK = (1 << 64) - 1


def splitmix64(seed: int, i: int) -> int:
    """The i-th output of splitmix64 seeded with `seed` (i from 0), as its authors wrote it."""
    z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


# ---------------------------------------------------------------- keys


def test_a_key_is_splitmix64_of_the_mixed_seed_and_the_rows_place():
    for seed, file, row in [(0, 0, 0), (7, 0, 12345), (-1, 3, 2**39), (2**70 + 5, 16_000_000, 1)]:
        mixed = splitmix64(seed & MASK, -1)  # the finalizer alone: z = seed
        assert int(shuffle.row_keys(seed, file, row, 1)[0]) == splitmix64(mixed, (file << 40) + row)


def test_keys_do_not_depend_on_how_rows_are_batched():
    whole = shuffle.row_keys(3, 2, 0, 10_000)
    parts = np.concatenate([shuffle.row_keys(3, 2, start, n) for start, n in [(0, 1), (1, 999), (1000, 9000)]])
    assert whole.dtype == np.uint64 and np.array_equal(whole, parts)
    assert np.array_equal(whole, shuffle.row_keys(3, 2, 0, 10_000))  # and not on when they are made


def test_keys_are_distinct_across_rows_and_files_and_change_with_the_seed():
    keys = np.concatenate([shuffle.row_keys(0, f, 0, 200_000) for f in range(5)])
    assert len(np.unique(keys)) == len(keys)
    other = np.concatenate([shuffle.row_keys(1, f, 0, 200_000) for f in range(5)])
    assert np.mean(np.argsort(keys) == np.argsort(other)) < 0.001


def chi2(counts: np.ndarray) -> float:
    expected = counts.sum() / counts.size
    return float(((counts - expected) ** 2 / expected).sum())


def test_the_permutation_looks_uniform():
    # Where each of 8 rows (4 in each of 2 files) lands over 4,000 seeds: every row at every place
    # equally often. df = 49, so chi-square is ~49 +- 10 and past 100 with probability < 1e-5.
    places = np.zeros((8, 8), dtype=np.int64)
    for seed in range(4000):
        keys = np.concatenate([shuffle.row_keys(seed, 0, 0, 4), shuffle.row_keys(seed, 1, 0, 4)])
        places[np.arange(8), np.argsort(np.argsort(keys))] += 1
    assert chi2(places) < 100, places
    # Which rows make the eval split (the smallest keys): each pair of rows as often as any other,
    # so rows are not picked together (df = 27, past 70 with probability < 1e-5).
    pairs = np.zeros((8, 8), dtype=np.int64)
    for seed in range(4000, 12_000):
        keys = np.concatenate([shuffle.row_keys(seed, 0, 0, 4), shuffle.row_keys(seed, 1, 0, 4)])
        a, b = sorted(np.argsort(keys)[:2])
        pairs[a, b] += 1
    assert chi2(pairs[np.triu_indices(8, 1)]) < 70, pairs
    # The buckets: the top 4 bits of consecutive rows' keys (df = 15, past 45 with p < 1e-4).
    top = shuffle.row_keys(0, 0, 0, 1 << 16) >> np.uint64(60)
    assert chi2(np.bincount(top.astype(np.int64), minlength=16)) < 45


def test_bucket_bits_grow_with_the_source_and_are_capped():
    assert shuffle.bucket_bits([("a.csv", 1000)]) == 0
    small = shuffle.bucket_bits([("a.csv", 100 << 20)])
    assert small >= 3 and shuffle.bucket_bits([("a.csv", 100 << 20), ("b.csv", 100 << 20)]) == small + 1
    assert shuffle.bucket_bits([("a.parquet", 100 << 20)]) == small + 1  # compressed: more per byte
    assert shuffle.bucket_bits([("a.csv", 1 << 50)]) == shuffle.MAX_BUCKET_BITS


def test_the_sort_unit_grows_with_the_source_between_its_bounds():
    # Small units for a small source (more overlap), big ones for a big source (fewer appends).
    assert shuffle.unit_bytes([("a.csv", 100 << 20)]) == shuffle.MIN_UNIT_BYTES
    assert shuffle.unit_bytes([("a.csv", 512 << 20)]) == 16 << 20  # 1 GB in memory / 64
    assert shuffle.unit_bytes([("a.parquet", 512 << 20)]) == shuffle.SORT_BYTES
    assert shuffle.unit_bytes([("a.csv", 1 << 40)]) == shuffle.SORT_BYTES
    # Between the bounds the bucket count stays at 64: a unit per bucket.
    assert shuffle.bucket_bits([("a.csv", 512 << 20)]) == shuffle.bucket_bits([("a.csv", 700 << 20)]) == 6


# ---------------------------------------------------------------- the passes


def make_source(folder: pathlib.Path, rows: int = 3000) -> list[dict]:
    """A folder of CSV, JSON-lines and Parquet files with the same columns; the rows they hold."""
    folder.mkdir()
    expected = [{"id": i, "x": i * 0.25, "name": f"n{i % 97}", "label": i % 3} for i in range(rows)]
    third = rows // 3
    for k in range(2):
        part = expected[k * third // 2 : (k + 1) * third // 2]
        (folder / f"a{k}.csv").write_text(
            "id,x,name,label\n" + "".join(f"{r['id']},{r['x']},{r['name']},{r['label']}\n" for r in part)
        )
    (folder / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in expected[third : 2 * third]))
    pq.write_table(pa.Table.from_pylist(expected[2 * third :]), folder / "c.parquet", row_group_size=100)
    return expected


def output_bytes(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def rows_of(folder: pathlib.Path) -> list[dict]:
    out = []
    for split in ("eval", "train"):
        m = json.loads((folder / split / "manifest.json").read_text())
        for s in m["shards"]:
            out += pq.read_table(folder / split / s["path"]).to_pylist()
    return out


def small_everything(monkeypatch) -> dict[str, int]:
    """Blocks, chunks, buckets, sort units and shard buffers far smaller than the data, so that every
    file is read in many pieces, buckets are sorted together and split, and shards are streamed."""
    calls = {"split": 0}
    real_split = shuffle._split

    def counting_split(*args, **kwargs):
        calls["split"] += 1
        return real_split(*args, **kwargs)

    monkeypatch.setattr(parse, "CSV_BLOCK_BYTES", 4096)
    monkeypatch.setattr(parse, "CSV_CHUNK_BYTES", 4096)
    monkeypatch.setattr(parse, "JSON_CHUNK_BYTES", 3000)
    monkeypatch.setattr(parse, "PARQUET_BATCH_BYTES", 1)
    monkeypatch.setattr(shuffle, "bucket_bits", lambda files: 3)
    monkeypatch.setattr(shuffle, "SORT_BYTES", 8000)
    monkeypatch.setattr(shuffle, "SPILL_BUFFER_BYTES", 5000)
    monkeypatch.setattr(shuffle, "_split", counting_split)
    monkeypatch.setattr(prep, "SHARD_BUFFER_BYTES", 2000)
    return calls


def test_the_shards_do_not_depend_on_batch_sizes_buckets_or_shard_buffers(tmp_path, monkeypatch):
    expected = make_source(tmp_path / "in")
    prepare(str(tmp_path / "in"), str(tmp_path / "default"), label="label", seed=5, shard_rows=700, row_group_rows=64)
    calls = small_everything(monkeypatch)
    prepare(str(tmp_path / "in"), str(tmp_path / "small"), label="label", seed=5, shard_rows=700, row_group_rows=64)
    assert calls["split"] > 0  # a bucket outgrew its sort unit and was split by the next key bits
    assert output_bytes(tmp_path / "small") == output_bytes(tmp_path / "default")
    key = lambda r: json.dumps(r, sort_keys=True)  # noqa: E731
    assert sorted(map(key, rows_of(tmp_path / "small"))) == sorted(map(key, expected))


def test_parallel_and_serial_give_the_same_shards(tmp_path, monkeypatch):
    make_source(tmp_path / "in")
    prepare(str(tmp_path / "in"), str(tmp_path / "serial"), label="label", seed=1, shard_rows=500)
    monkeypatch.setattr(shuffle, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(shuffle, "usable_cpus", lambda: 4)  # a pool whatever the CPUs
    spill = shuffle.spill
    seen = []
    monkeypatch.setattr(shuffle, "spill", lambda *args: seen.append(args[-1]) or spill(*args))
    prepare(str(tmp_path / "in"), str(tmp_path / "parallel"), label="label", seed=1, shard_rows=500)
    assert seen == [2]  # four files, a process each up to the CPUs
    assert output_bytes(tmp_path / "parallel") == output_bytes(tmp_path / "serial")


def test_in_parallel_the_error_is_the_first_failing_files(tmp_path, monkeypatch):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.csv").write_text("a,label\n1,0\n2,1\n")
    (tmp_path / "in" / "b.csv").write_text("a,label\n1,\n")  # a missing label
    (tmp_path / "in" / "c.csv").write_text("a,label\n1,0\n2,1,3\n")  # a field too many
    monkeypatch.setattr(shuffle, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(shuffle, "usable_cpus", lambda: 4)
    for _ in range(2):
        with pytest.raises(DataError, match=r"b\.csv line 2, column 'label': the label is missing"):
            prepare(str(tmp_path / "in"), str(tmp_path / "out"), label="label")
    assert not (tmp_path / "out").exists()


def test_a_restarted_file_leaves_no_rows_behind(tmp_path, monkeypatch):
    # The first blocks say int64; a later one holds text: the file is read again as strings, and the
    # rows spilled as int64 before must go (in the bucket files of this process, which other files share).
    monkeypatch.setattr(parse, "CSV_BLOCK_BYTES", 1024)
    monkeypatch.setattr(parse, "CSV_CHUNK_BYTES", 1024)
    monkeypatch.setattr(shuffle, "SPILL_BUFFER_BYTES", 1000)  # rows reach the files before the restart
    (tmp_path / "in").mkdir()
    for name, odd in (("a.csv", "x"), ("b.csv", "y")):  # b's rows are truncated after a's in each bucket file
        (tmp_path / "in" / name).write_text("v,label\n" + "".join(f"{i},{i % 2}\n" for i in range(3000)) + f"{odd},1\n")
    forgotten = []
    forget = shuffle._Buckets.forget
    monkeypatch.setattr(shuffle._Buckets, "forget", lambda self: forgotten.append(self.rows.sum()) or forget(self))
    r = prepare(str(tmp_path / "in"), str(tmp_path / "out"), label="label")
    assert len(forgotten) == 2 and min(forgotten) > 0  # each file was read again, after spilling rows
    assert [(f.name, f.type) for f in r.train.schema] == [("v", "string"), ("label", "int64")]
    got = sorted(row["v"] for row in rows_of(tmp_path / "out"))
    assert got == sorted([str(i) for i in range(3000)] * 2 + ["x", "y"])
