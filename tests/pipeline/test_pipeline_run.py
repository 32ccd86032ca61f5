"""The whole train→evaluate pipeline run for real through kfp.local (SubprocessRunner, real
TensorFlow training on the local backend), through the README's main command."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_pipeline(tmp_path, *extra, env=None):
    return subprocess.run([sys.executable, "-m", "elastic_step.cli", "pipeline", "run", "--source",
                           "samples/digits/digits.csv", "--model-def", "samples/digits/model.py", "--label", "label",
                           "--output", str(tmp_path / "run"), "--publish-uri", str(tmp_path / "published"), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**{k: v for k, v in os.environ.items() if k != "ELASTIC_STEP_CHAOS"}, **(env or {})})


@pytest.mark.slow
def test_pipeline_runs_locally_and_passes_the_gate(tmp_path):
    proc = run_pipeline(tmp_path, "--epochs", "10")
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["evaluation"]["passed"] is True
    assert result["evaluation"]["score"] >= 0.90
    assert result["evaluation"]["metrics"]["accuracy"] >= 0.90
    assert {"data-prep-op", "elastic-train-op", "evaluate-op", "publish-model-op"} <= set(result["tasks"])
    assert result["publish"]["published_to"] == str(tmp_path / "published")
    assert (tmp_path / "published" / "model.keras").is_file()
    assert (tmp_path / "published" / "saved_model" / "saved_model.pb").is_file()
    run = pathlib.Path(result["run"])
    assert run.parent == (tmp_path / "run" / "pipeline_root").resolve()
    for artifact in ("data-prep-op.train_data", "data-prep-op.eval_data", "elastic-train-op.model",
                     "elastic-train-op.report", "elastic-train-op.summary"):
        assert pathlib.Path(result["artifacts"][artifact]).is_relative_to(run), artifact
        assert os.path.exists(result["artifacts"][artifact]), artifact
    assert (pathlib.Path(result["artifacts"]["data-prep-op.train_data"]) / "manifest.json").is_file()
    summary = json.loads(pathlib.Path(result["artifacts"]["elastic-train-op.summary"]).read_text())
    assert summary["status"] == "succeeded" and summary["epochs"] == 10
    assert (pathlib.Path(result["artifacts"]["elastic-train-op.model"]) / "saved_model" / "saved_model.pb").is_file()
    # Metrics and ClassificationMetrics are metadata (kfp.local keeps them in executor_output.json)
    assert result["training"]["eval_accuracy"] >= 0.9 and result["training"]["throughput_records_per_s"] > 0
    assert result["training"]["workers_lost"] == 0
    confusion = result["metadata"]["evaluate-op.classification_metrics"]["confusionMatrix"]
    assert len(confusion["annotationSpecs"]) == 10 and len(confusion["rows"]) == 10
    assert sum(sum(r["row"]) for r in confusion["rows"]) == result["evaluation"]["metrics"]["records"]
    rows = {k: result["metadata"][f"data-prep-op.{k}"]["rows"] for k in ("train_data", "eval_data")}
    assert rows["train_data"] == summary["records_per_epoch"] and rows["eval_data"] == summary["eval"]["records"]
    assert "PASSED the gate" in proc.stderr and f"published: {tmp_path / 'published'}" in proc.stderr


@pytest.mark.slow
def test_pipeline_survives_a_killed_worker(tmp_path):
    """ELASTIC_STEP_CHAOS (read by the training runtime) SIGKILLs worker-0 after 2000 committed records."""
    proc = run_pipeline(tmp_path, "--epochs", "10", env={"ELASTIC_STEP_CHAOS": "kill:worker-0@2000"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    summary = json.loads(pathlib.Path(result["artifacts"]["elastic-train-op.summary"]).read_text())
    assert summary["status"] == "succeeded"
    assert summary["workers"]["lost"] >= 1 and summary["workers"]["relaunched"] >= 1
    kinds = [(e["kind"], e.get("instance")) for e in summary["events"]]
    assert ("lost", "worker-0") in kinds
    assert any(e["kind"] == "decision" and e["detail"].startswith("relaunch: worker-0") for e in summary["events"])
    assert all(e["lost"] == 0 and e["double_applied"] == 0 and e["committed"] == e["records"]
               for e in summary["ledger"]["epochs"])
    assert result["training"]["workers_lost"] >= 1 and result["training"]["workers_relaunched"] >= 1
    report = pathlib.Path(result["artifacts"]["elastic-train-op.report"]).read_text()
    assert "worker-0" in report and "lost" in report and "relaunch" in report
    assert result["evaluation"]["passed"] is True
    assert (tmp_path / "published" / "model.keras").is_file()


@pytest.mark.slow
def test_a_model_below_the_threshold_is_not_published(tmp_path):
    proc = run_pipeline(tmp_path, "--epochs", "1", "--threshold", "1.01")
    assert proc.returncode == 0, proc.stderr[-4000:]  # a closed gate is a result, not an error
    result = json.loads(proc.stdout)
    assert result["evaluation"]["passed"] is False and result["evaluation"]["score"] < 1.01
    assert "publish-model-op" not in result["tasks"]
    assert result["publish"] == {"ran": False, "published_to": None,
                                 "note": "skipped: the model did not pass the gate"}
    assert not (tmp_path / "published").exists()
    assert "did NOT pass the gate" in proc.stderr
