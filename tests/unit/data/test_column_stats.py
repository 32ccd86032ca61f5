"""Column statistics: recorded by prep in each split's manifest, in its one streaming pass, equal to the
statistics of the split's records, and read back by the public helper that model(statistics) users call."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

import elastic_step.data
from elastic_step.data import column_stats
from elastic_step.data.column_stats import ColumnStatistics
from elastic_step.data.prep import prepare
from elastic_step.data.reader import read_all
from elastic_step.errors import DataError


def test_prep_records_each_splits_statistics_as_its_records_give_them(tmp_path):
    rng = np.random.default_rng(0)
    n = 3000
    x, ids = rng.normal(5.0, 2.0, n), rng.integers(0, 40, n)
    cities = rng.choice(["oslo", "lima", "pune", "kyiv"], n, p=[0.5, 0.3, 0.15, 0.05])
    lines = "".join(f"{a:.6f},{i},{c},{i % 2}\n" for a, i, c in zip(x, ids, cities))
    (tmp_path / "d.csv").write_text("x,id,city,label\n" + lines)
    # Small shards and row groups: the statistics merge over many tables.
    r = prepare(str(tmp_path / "d.csv"), str(tmp_path / "out"), label="label", shard_rows=700, row_group_rows=100)
    for uri in (r.train_uri, r.eval_uri):
        rows, stats = read_all(uri), elastic_step.data.statistics(uri)
        for column in ("x", "id", "label"):
            values = rows[column].astype(np.float64)
            got = stats[column]
            assert got["count"] == len(values)
            assert got["mean"] == pytest.approx(values.mean(), rel=1e-9)
            assert got["variance"] == pytest.approx(values.var(), rel=1e-9)  # Normalization.adapt's (ddof 0)
            assert (got["min"], got["max"]) == (values.min(), values.max())
        for column in ("id", "city"):
            values, counts = np.unique(rows[column], return_counts=True)
            expected = sorted(zip(values.tolist(), counts.tolist()), key=lambda vc: (-vc[1], str(vc[0])))
            assert list(zip(stats[column]["vocabulary"], stats[column]["counts"])) == expected
            assert stats[column]["complete"] is True
        assert "vocabulary" not in stats["x"] and "mean" not in stats["city"]


def test_a_vocabulary_stops_at_its_cap_and_says_so(monkeypatch):
    monkeypatch.setattr(column_stats, "MAX_VOCABULARY", 3)
    stats = ColumnStatistics()
    stats.add(pa.table({"s": ["a", "a", "b", "c"]}))
    stats.add(pa.table({"s": ["d", "a", "c", "e"]}))  # d and e come after the cap; a and c keep counting
    got = stats.result()["s"]
    assert got == {"vocabulary": ["a", "c", "b"], "counts": [3, 2, 1], "complete": False}


def test_a_manifest_without_statistics_is_named_with_the_fix(tmp_path):
    (tmp_path / "d.csv").write_text("x,label\n" + "".join(f"{i},{i % 2}\n" for i in range(20)))
    r = prepare(str(tmp_path / "d.csv"), str(tmp_path / "out"), label="label")
    path = tmp_path / "out" / "train" / "manifest.json"
    raw = json.loads(path.read_text())
    del raw["statistics"]
    path.write_text(json.dumps(raw))
    with pytest.raises(DataError, match="holds no column statistics.*Re-run `elastic-step data prep`"):
        elastic_step.data.statistics(r.train_uri)
