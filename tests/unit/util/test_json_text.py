"""Strict JSON: what every output of ours writes."""

from __future__ import annotations

import json

import numpy as np

from elastic_step.util import json_text


def strict_loads(text: str):
    """json.loads as a strict parser (JavaScript's, Go's, jq) reads: NaN and Infinity are no JSON."""

    def refuse(name):
        raise ValueError(f"bare {name} in JSON")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_null_and_numpy_values_plain(tmp_path):
    value = {
        "loss": float("nan"),
        "auc": np.float32(0.75),
        "curve": [1.0, float("inf"), -float("inf")],
        "steps": np.int64(7),
        "rows": np.array([[1.5, np.nan]]),
        "pair": (np.float64("nan"), "x"),
        "where": tmp_path,  # anything else: its str()
    }
    expected = {
        "loss": None,
        "auc": 0.75,
        "curve": [1.0, None, None],
        "steps": 7,
        "rows": [[1.5, None]],
        "pair": [None, "x"],
        "where": str(tmp_path),
    }
    assert strict_loads(json_text.dumps(value)) == expected
    json_text.write_json(str(tmp_path / "out.json"), value)
    assert strict_loads((tmp_path / "out.json").read_text()) == expected
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # written atomically: no temporary left
