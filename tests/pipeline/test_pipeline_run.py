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


def run_pipeline(tmp_path, *extra, env=None, source="samples/digits/digits.csv", publish=None, output=None):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_step.cli",
            "pipeline",
            "run",
            "--source",
            str(source),
            "--model-def",
            "samples/digits/model.py",
            "--label",
            "label",
            "--output",
            str(output or tmp_path / "run"),
            "--publish-uri",
            publish or str(tmp_path / "published"),
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        env={
            **{k: v for k, v in os.environ.items() if k not in ("ELASTIC_STEP_CHAOS", "AIP_TENSORBOARD_LOG_DIR")},
            **(env or {}),
        },
    )


@pytest.mark.slow
def test_pipeline_runs_locally_with_everything_in_a_bucket_and_passes_the_gate(tmp_path, s3_server):
    """The source, the published model and kfp.local's pipeline_root, all in one bucket (moto's S3 server).
    kfp.local writes its pipeline_root only through local paths, so the bucket is mounted there with
    s3fs-fuse, as Vertex AI Pipelines mounts gs:// at /gcs/; the source and publish URIs are s3:// ones.
    What the run wrote is read back from the bucket through the store's API, not through the mount."""
    fs = s3_server.filesystem()
    bucket = s3_server.bucket("pipeline-run")
    fs.put_file(str(ROOT / "samples" / "digits" / "digits.csv"), "pipeline-run/source/digits.csv")
    with s3_server.mounted("pipeline-run") as mounted:
        proc = run_pipeline(
            tmp_path,
            "--epochs",
            "10",
            "--json",
            env=s3_server.env,
            output=f"{mounted}/run",
            source=f"{bucket}/source/digits.csv",
            publish=f"{bucket}/published",
        )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["evaluation"]["passed"] is True
    assert result["evaluation"]["score"] >= 0.90
    assert result["evaluation"]["metrics"]["accuracy"] >= 0.90
    assert {"data-prep-op", "elastic-train-op", "evaluate-op", "publish-model-op"} <= set(result["tasks"])
    assert result["publish"]["published_to"] == f"{bucket}/published"
    assert fs.exists("pipeline-run/published/model.keras")
    assert fs.exists("pipeline-run/published/saved_model/saved_model.pb")

    def in_bucket(path: str) -> str:  # a path under the mount -> the object's key in the bucket
        return f"pipeline-run/{os.path.relpath(path, mounted)}"

    fs.invalidate_cache()
    run = result["run"]
    assert pathlib.Path(run).parent == pathlib.Path(mounted) / "run" / "pipeline_root"
    for artifact in (
        "data-prep-op.train_data",
        "data-prep-op.eval_data",
        "elastic-train-op.model",
        "elastic-train-op.report",
        "elastic-train-op.summary",
    ):
        assert pathlib.Path(result["artifacts"][artifact]).is_relative_to(run), artifact
        assert fs.exists(in_bucket(result["artifacts"][artifact])), artifact
    assert fs.isfile(in_bucket(result["artifacts"]["data-prep-op.train_data"]) + "/manifest.json")
    summary = json.loads(fs.cat_file(in_bucket(result["artifacts"]["elastic-train-op.summary"])))
    assert summary["status"] == "succeeded" and summary["epochs"] == 10
    assert fs.isfile(in_bucket(result["artifacts"]["elastic-train-op.model"]) + "/saved_model/saved_model.pb")
    # Metrics and ClassificationMetrics are metadata (kfp.local keeps them in executor_output.json)
    assert result["training"]["eval_accuracy"] >= 0.9 and result["training"]["throughput_records_per_s"] > 0
    assert result["training"]["workers_lost"] == 0
    confusion = result["metadata"]["evaluate-op.classification_metrics"]["confusionMatrix"]
    assert len(confusion["annotationSpecs"]) == 10 and len(confusion["rows"]) == 10
    assert sum(sum(r["row"]) for r in confusion["rows"]) == result["evaluation"]["metrics"]["records"]
    rows = {k: result["metadata"][f"data-prep-op.{k}"]["rows"] for k in ("train_data", "eval_data")}
    assert rows["train_data"] == summary["records_per_epoch"] and rows["eval_data"] == summary["eval"]["records"]
    assert "PASSED the gate" in proc.stderr and f"published: {bucket}/published" in proc.stderr


# The digits, 16 variants of each (samples/digits/make_csv.py): 23 002 training rows, 230 020 records in
# 10 epochs, so training lasts long enough for a kill and a relaunch on any machine.
COPIES = 16
# One SIGKILL once 43 % of the records are committed, to a worker holding a lease (seed 4 draws a kill,
# worker-0 first). Unlike kill:worker-0@N it does not wait for both workers to train, so a second worker
# slow to start on a loaded machine cannot push it past the end of training: it fires in every run.
CHAOS = "random:1:seed=4"


@pytest.mark.slow
def test_pipeline_survives_a_killed_worker(tmp_path):
    """--chaos (ELASTIC_STEP_CHAOS for the training runtime) SIGKILLs a worker mid-training; the run
    trains on, relaunches it, passes the gate, and its TensorBoard event files hold what summary.json does."""
    from samples.digits.make_csv import make_augmented_csv
    from tests.tensorboard_events import read_scalars

    make_augmented_csv(str(tmp_path / "digits.csv"), copies=COPIES)
    proc = run_pipeline(tmp_path, "--epochs", "10", "--chaos", CHAOS, "--json", source=tmp_path / "digits.csv")
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    summary = json.loads(pathlib.Path(result["artifacts"]["elastic-train-op.summary"]).read_text())
    assert summary["status"] == "succeeded"
    fired = summary.get("chaos", {}).get("fired")
    if fired is None:  # a runtime that does not list what fired: the loss itself is the evidence
        assert summary["workers"]["lost"] >= 1, f"the chaos ({CHAOS}) never fired: no worker was lost"
        killed = "worker-0"
    else:
        assert fired, f"the chaos ({CHAOS}) never fired: {summary['chaos']}"
        killed = fired[0]["instance"]
    assert summary["workers"]["lost"] >= 1 and summary["workers"]["relaunched"] >= 1
    kinds = [(e["kind"], e.get("instance")) for e in summary["events"]]
    assert ("lost", killed) in kinds
    assert any(e["kind"] == "decision" and e["detail"].startswith(f"relaunch: {killed}") for e in summary["events"])
    assert all(
        e["lost"] == 0 and e["double_applied"] == 0 and e["committed"] == e["records"]
        for e in summary["ledger"]["epochs"]
    )
    if "audit" in summary:
        assert summary["audit"]["verdict"] == "exact", summary["audit"]
    assert result["training"]["workers_lost"] >= 1 and result["training"]["workers_relaunched"] >= 1
    report = pathlib.Path(result["artifacts"]["elastic-train-op.report"]).read_text()
    assert killed in report and "lost" in report and "relaunch" in report
    assert result["evaluation"]["passed"] is True
    assert (tmp_path / "published" / "model.keras").is_file()

    # TensorBoard, read back with TensorFlow's reader: every progress sample of the master (all but the
    # final one, taken after training) and every evaluation point, as summary.json has them.
    tensorboard = pathlib.Path(result["tensorboard"])
    assert tensorboard.is_relative_to((tmp_path / "run" / "tensorboard").resolve())
    scalars = read_scalars(tensorboard)
    samples = summary["timeseries"]

    def written(key):
        return [(s["records"], pytest.approx(s[key], rel=1e-6)) for s in samples if s[key] is not None]

    for tag, key in (
        ("workers/alive", "workers_alive"),
        ("train/records_per_s", "records_per_s"),
        ("train/loss", "loss"),
    ):
        assert len(written(key)) - 1 <= len(scalars[tag]) <= len(written(key)), tag
        assert scalars[tag] == written(key)[: len(scalars[tag])], tag
    alive = [n for _, n in scalars["workers/alive"]]
    assert any(later < earlier for earlier, later in zip(alive, alive[1:])), f"no loss in workers/alive: {alive}"
    per_epoch = summary["records_per_epoch"]
    expected = {(e["epoch"] + 1) * per_epoch: e["accuracy"] for e in summary["eval_history"]}
    expected[summary["epochs"] * per_epoch] = summary["eval"]["accuracy"]  # the final evaluation
    assert dict(scalars["eval/accuracy"]) == pytest.approx(expected, rel=1e-6)
    assert 0 in expected  # the curve starts at the initial weights


@pytest.mark.slow
def test_a_model_below_the_threshold_is_not_published(tmp_path):
    """Without --json, stdout is the summary for a person: the gate's outcome, the audit's verdict and
    where the report, the TensorBoard logs and summary.json are."""
    proc = run_pipeline(tmp_path, "--epochs", "1", "--threshold", "1.01")
    assert proc.returncode == 0, proc.stderr[-4000:]  # a closed gate is a result, not an error
    text = proc.stdout
    assert text.startswith("Pipeline run finished: ")
    assert "NOT passed; model not published (skipped: the model did not pass the gate)" in text
    assert not (tmp_path / "published").exists()
    rows = dict(
        line.strip().split(None, 1)
        for line in text.splitlines()[1:]
        if line.startswith("  ") and not line.strip().startswith("(")
    )
    run = pathlib.Path(text.splitlines()[0].split(": ", 1)[1])
    assert run.parent == (tmp_path / "run" / "pipeline_root").resolve() and "publish-model-op" not in os.listdir(run)
    assert float(rows["accuracy"].split()[0]) < 1.01
    summary = json.loads(pathlib.Path(rows["summary"]).read_text())
    assert pathlib.Path(rows["report"]).is_file() and pathlib.Path(rows["report"]).is_relative_to(run)
    assert f"{summary['ledger']['records_committed']:,} records" in rows["training"]
    assert "0 lost, 0 rejoined" in rows["workers"]
    verdict = summary.get("audit", {}).get("verdict")
    assert rows["exactly-once"].startswith("audit exact" if verdict == "exact" else "audit not available")
    assert list(pathlib.Path(rows["tensorboard"].split()[0]).glob("events.out.tfevents.*"))
