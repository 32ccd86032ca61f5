"""ShardReader: exact record ranges of prepared shards, across row-group boundaries."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_step.data.prep import prepare
from elastic_step.data.reader import ReaderPool, ShardReader, read_all
from elastic_step.errors import DataError

ROWS, SHARD_ROWS, GROUP_ROWS = 100, 45, 8  # 90 train rows: two shards of 45, row groups of 8


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reader")
    text = "id,x,name,label\n" + "".join(f"{i},{i / 4},r{i},{i % 3}\n" for i in range(ROWS))
    (tmp / "d.csv").write_text(text)
    result = prepare(
        str(tmp / "d.csv"),
        str(tmp / "out"),
        label="label",
        eval_fraction=0.1,
        shard_rows=SHARD_ROWS,
        row_group_rows=GROUP_ROWS,
    )
    return result.train


def source_rows(manifest, shard):
    """The shard's rows as written, read whole by pyarrow: the reference for every range."""
    return pq.read_table(manifest.shard_uri(shard)).to_pydict()


def test_shards_have_small_row_groups(prepared):
    assert [s.rows for s in prepared.shards] == [45, 45]
    md = pq.ParquetFile(prepared.shard_uri(prepared.shards[0])).metadata
    assert [md.row_group(i).num_rows for i in range(md.num_row_groups)] == [8] * 5 + [5]


def test_read_all_is_every_shard_in_manifest_order(prepared):
    got = read_all(prepared)
    expected = [source_rows(prepared, s) for s in prepared.shards]
    assert list(got["id"]) == [i for rows in expected for i in rows["id"]]
    assert len(got["id"]) == 90 and set(got) == set(expected[0])
    assert list(read_all(prepared.uri)["id"]) == list(got["id"])  # by URI too


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_range_equals_the_source_rows(prepared, data):
    shard = prepared.shards[data.draw(st.integers(0, len(prepared.shards) - 1))]
    start = data.draw(st.integers(0, shard.rows))
    end = data.draw(st.integers(start, shard.rows))
    expected = source_rows(prepared, shard)
    reader = ShardReader(prepared.shard_uri(shard))
    try:
        got = reader.read(start, end)
    finally:
        reader.close()
    assert set(got) == set(expected)
    for column, values in got.items():
        assert values.tolist() == expected[column][start:end]


def test_consecutive_minibatches_cover_a_task_exactly_once(prepared):
    shard = prepared.shards[1]
    expected = source_rows(prepared, shard)["id"]
    pool = ReaderPool(columns=["id", "label"])
    try:
        ids = []
        for start in range(3, 41, 5):  # a task [3, 41) in minibatches of 5, crossing row groups
            batch = pool.read(prepared.shard_uri(shard), start, min(start + 5, 41))
            assert set(batch) == {"id", "label"}
            ids += batch["id"].tolist()
    finally:
        pool.close()
    assert ids == expected[3:41]


def test_reads_only_the_row_groups_a_range_spans(prepared, monkeypatch):
    reader = ShardReader(prepared.shard_uri(prepared.shards[0]))
    asked = []
    real = reader._pq.read_row_groups

    def spy(groups, **kwargs):
        asked.append(groups)
        return real(groups, **kwargs)

    monkeypatch.setattr(reader._pq, "read_row_groups", spy)
    try:
        assert reader.read(10, 20)["id"].shape == (10,)  # rows 8..23 are groups 1 and 2
        assert asked == [[1, 2]]
        reader.read(41, 45)
        assert asked[-1] == [5]
    finally:
        reader.close()


def test_dtypes_follow_the_manifest_schema(prepared):
    reader = ShardReader(prepared.shard_uri(prepared.shards[0]))
    try:
        batch = reader.read(0, 4)
    finally:
        reader.close()
    assert batch["id"].dtype == np.int64 and batch["x"].dtype == np.float64
    assert [f.type for f in prepared.schema] == ["int64", "float64", "string", "int64"]


def test_out_of_range_is_a_data_error(prepared):
    reader = ShardReader(prepared.shard_uri(prepared.shards[0]))
    try:
        with pytest.raises(DataError, match=r"outside"):
            reader.read(40, 46)
    finally:
        reader.close()
