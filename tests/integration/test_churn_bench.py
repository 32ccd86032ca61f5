"""bench/churn.py's smoke: a tiny trace, one run, elastic-step `ps`, TensorFlow's ParameterServerStrategy and a lone
`fit` with BackupAndRestore, through the bench's own command line, with its plots."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_churn_bench_replays_one_trace_on_elastic_step_and_on_its_peers(tmp_path):
    out = tmp_path / "churn.json"
    cmd = [sys.executable, "bench/churn.py", "--sides", "ps", "psstrategy", "fit", "--churn", "none", "heavy"]
    cmd += ["--runs", "1", "--rows", "3000", "--epochs", "2", "--job-minutes", "4", "--budget-s", "240"]
    cmd += ["--json", str(out), "--svg", str(tmp_path / "churn")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {(r["side"], r["churn"]): r for r in json.loads(out.read_text())}
    assert set(runs) == {(s, c) for s in ("ps", "psstrategy", "fit") for c in ("none", "heavy")}
    for r in runs.values():
        assert r["time_to_target_s"] > 0 and r["accuracy"] > 0.8, r
        assert r["preemptions"] == len(r["fired_at"]) <= r["due"], r
    assert all(runs[s, "none"]["preemptions"] == 0 for s in ("ps", "psstrategy", "fit"))
    assert runs["ps", "heavy"]["trace"] == runs["psstrategy", "heavy"]["trace"] == runs["fit", "heavy"]["trace"] > 0
    assert runs["ps", "heavy"]["due"] == runs["psstrategy", "heavy"]["due"] == runs["ps", "heavy"]["trace"]
    assert runs["ps", "heavy"]["audit"] == "exact"
    fit = runs["fit", "heavy"]
    assert fit["restarts"] == fit["preemptions"] >= 1  # every loss restarted it from its backup
    assert fit["records_trained_again"] >= 0
    ps = runs["psstrategy", "heavy"]
    assert ps["restarts"] == ps["preemptions"] >= 1  # each killed worker started again on its address
    assert ps["records_trained_again"] >= 0
    assert "goodput" in proc.stdout and "fired/due" in proc.stdout
    assert (tmp_path / "churn-none.svg").exists() and (tmp_path / "churn-heavy.svg").exists()
