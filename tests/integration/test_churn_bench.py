"""bench/churn.py's smokes, through the bench's own command line: a tiny trace, one run. Locally: elastic-step `ps`,
TensorFlow's ParameterServerStrategy and a lone `fit` with BackupAndRestore, with its plots. On a control plane of its
own (the Kubernetes backend): elastic-step `ps` and MultiWorkerMirrored restarted whole by its operator, kube-scheduler
making the preemptions; its own Events witness them (a pod created to take the worker's node, not a deletion)."""

from __future__ import annotations

import json
import os
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


@pytest.mark.kubernetes
def test_kube_scheduler_preempts_on_the_trace_and_each_side_recovers_as_its_operator_does(tmp_path):
    out = tmp_path / "churn.json"
    cmd = [sys.executable, "bench/churn.py", "--backend", "kubernetes", "--sides", "ps", "mwms", "--churn", "heavy"]
    cmd += ["--runs", "1", "--rows", "3000", "--epochs", "3", "--job-minutes", "4", "--pending-s", "1"]
    cmd += ["--budget-s", "300", "--json", str(out)]
    # Its pods' loopback addresses apart from those of a control plane this session runs (the harness keys them to
    # the xdist worker).
    env = {**os.environ, "PYTEST_XDIST_WORKER": "gw9"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r["side"]: r for r in json.loads(out.read_text())}
    assert set(runs) == {"ps", "mwms"}
    assert runs["ps"]["trace"] == runs["mwms"]["trace"] > 0
    for r in runs.values():
        assert r["time_to_target_s"] > 0 and r["accuracy"] > 0.8, r
        assert 1 <= r["preemptions"] == len(r["fired_at"]) == len(r["preempted"]) <= r["due"], r
        # The preemptions the bench set off were kube-scheduler's: its Events name the pods the trace aimed at, every
        # one but perhaps the last, which the job's end may overtake (trained, its pods go before the scheduler acts).
        aimed = [p["pod"] for p in r["preempted"]]
        assert set(r["scheduler_preempted"]) <= set(aimed), r
        assert len(r["scheduler_preempted"]) >= max(1, len(aimed) - 1), r
    assert runs["ps"]["audit"] == "exact"
    assert runs["mwms"]["restarts"] == runs["mwms"]["preemptions"]  # each loss restarted every worker
