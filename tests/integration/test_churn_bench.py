"""bench/churn.py's smoke: a tiny trace, one run, elastic-step `ps` and a lone `fit` with BackupAndRestore, through
the bench's own command line."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_churn_bench_replays_one_trace_on_elastic_step_and_on_a_restarted_fit(tmp_path):
    out = tmp_path / "churn.json"
    cmd = [sys.executable, "bench/churn.py", "--sides", "ps", "fit", "--churn", "none", "heavy", "--runs", "1"]
    cmd += ["--rows", "3000", "--epochs", "2", "--job-minutes", "4", "--budget-s", "240", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {(r["side"], r["churn"]): r for r in json.loads(out.read_text())}
    assert set(runs) == {("ps", "none"), ("ps", "heavy"), ("fit", "none"), ("fit", "heavy")}
    for r in runs.values():
        assert r["time_to_target_s"] > 0 and r["accuracy"] > 0.8, r
    assert runs["ps", "none"]["preemptions"] == runs["fit", "none"]["preemptions"] == 0
    assert runs["ps", "heavy"]["trace"] == runs["fit", "heavy"]["trace"] > 0  # one trace, both sides
    assert runs["ps", "heavy"]["audit"] == "exact"
    fit = runs["fit", "heavy"]
    assert fit["restarts"] == fit["preemptions"] >= 1  # every loss restarted it from its backup
    assert fit["records_trained_again"] >= 0
    assert "goodput" in proc.stdout
