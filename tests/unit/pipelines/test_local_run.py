"""`elastic-step pipeline run`'s output: the summary for a person on stdout, and the whole result
behind --json. The pipeline itself is stubbed here (tests/pipeline/test_pipeline_run.py runs it for real)."""

from __future__ import annotations

import json

import pytest

from elastic_step import cli
from elastic_step.pipelines import local_run
from elastic_step.pipelines.local_run import summary_text

AUDIT_EXACT = {
    "source": "ps",
    "holders": 1,
    "where": "on all 1 PS shard(s)",
    "verdict": "exact",
    "records_outside_the_data": 0,
    "epochs": [
        {"epoch": e, "records": 9200, "applied_once": 9200, "never": 0, "more_than_once": 0, "shards_disagree": 0}
        for e in range(2)
    ],
}
AUDIT_VIOLATED = {
    **AUDIT_EXACT,
    "verdict": "violated",
    "epochs": [
        {"epoch": 0, "records": 9200, "applied_once": 9136, "never": 0, "more_than_once": 64, "shards_disagree": 0}
    ],
}


def training_summary(**changes) -> dict:
    s = {
        "status": "succeeded",
        "epochs": 2,
        "records_per_epoch": 9200,
        "training_seconds": 31.4,
        "startup_seconds": 6.2,
        "throughput_records_per_s": 24000.0,
        "ledger": {"records_committed": 18400, "epochs": []},
        "workers": {"started": 3, "lost": 1, "relaunched": 1, "max_alive": 2},
        "recovery": {"first_commit_after_loss_s": [4.1]},
        "chaos": {
            "schedule": [{"action": "kill", "at_records": 6000, "instance": "worker-0"}],
            "fired": [{"action": "kill", "instance": "worker-0", "at_records": 6016}],
            "not_fired": [],
        },
        "audit": AUDIT_EXACT,
        "goodput": {
            "ratio": 0.71,
            "worker_ratio": 0.64,
            "wall_s": {"training": 71.0, "startup": 20.0, "rewind": 9.0},
            "worker_s": {"training": 128.0, "startup": 60.0, "rewind": 12.0},
        },
    }
    s.update(changes)
    return s


def run_result(tmp_path, summary: dict | None, passed: bool = True) -> dict:
    train = tmp_path / "run" / "elastic-train-op"
    train.mkdir(parents=True, exist_ok=True)
    artifacts = {"elastic-train-op.report": str(train / "report"), "elastic-train-op.summary": str(train / "summary")}
    if summary is not None:
        (train / "summary").write_text(json.dumps(summary))
    publish = (
        {"ran": True, "published_to": str(tmp_path / "published")}
        if passed
        else {"ran": False, "published_to": None, "note": "skipped: the model did not pass the gate"}
    )
    return {
        "run": str(tmp_path / "run"),
        "tasks": [],
        "training": {},
        "artifacts": artifacts,
        "metadata": {},
        "evaluation": {
            "score": 0.9712 if passed else 0.42,
            "passed": passed,
            "metrics": {"accuracy": 0.9712 if passed else 0.42, "loss": 0.1, "records": 2300},
        },
        "publish": publish,
        "gate": {"metric": "accuracy", "threshold": 0.9},
        "chaos": ["kill:worker-0@6000"],
        "tensorboard": str(tmp_path / "tensorboard" / "20260101-000000"),
    }


def test_the_summary_names_accuracy_gate_losses_audit_and_where_things_are(tmp_path):
    result = run_result(tmp_path, training_summary())
    text = summary_text(result)
    assert "accuracy      0.9712 on 2,300 eval records" in text
    assert f"accuracy 0.9712 >= 0.9: PASSED; model published to {tmp_path / 'published'}" in text
    assert "18,400 records (2 epochs of 9,200) in 31.4 s" in text
    assert "1 lost, 1 rejoined" in text and "kill worker-0 at 6,016 records" in text and "on purpose" in text
    assert "audit exact" in text
    assert "goodput 71 % of wall time (64 % of worker-seconds); lost to start-up 20 %, training again 9 %" in text
    assert result["artifacts"]["elastic-train-op.report"] in text
    assert f"tensorboard --logdir {result['tensorboard']}" in text
    assert "--json" in text


def test_a_closed_gate_a_violated_audit_and_chaos_that_never_fired_are_said_plainly(tmp_path):
    summary = training_summary(
        audit=AUDIT_VIOLATED,
        workers={"lost": 0, "relaunched": 0, "max_alive": 2},
        recovery={"first_commit_after_loss_s": []},
        chaos={"schedule": [], "fired": [], "not_fired": [{"action": "kill", "at_records": 6000}]},
    )
    text = summary_text(run_result(tmp_path, summary, passed=False))
    assert "accuracy 0.4200 >= 0.9: NOT passed; model not published (skipped: the model did not pass the gate)" in text
    assert "audit VIOLATED" in text and "64 more than once" in text
    assert "0 lost, 0 rejoined" in text and "chaos kill at 6,000 records NEVER fired" in text


@pytest.mark.parametrize(
    "audit", [None, {"source": "ps", "verdict": "unavailable", "reason": "no evidence", "epochs": []}]
)
def test_an_audit_missing_or_unavailable_is_reported_as_not_available(tmp_path, audit):
    summary = training_summary(audit=audit) if audit else {k: v for k, v in training_summary().items() if k != "audit"}
    text = summary_text(run_result(tmp_path, summary))
    assert "audit not available" in text and "audit exact" not in text


def test_a_missing_training_summary_is_said_not_invented(tmp_path):
    text = summary_text(run_result(tmp_path, None))
    assert "no summary.json from the training step" in text and "audit" not in text


@pytest.fixture
def stub_pipeline(tmp_path, monkeypatch):
    """run_local replaced by a stub that records its arguments and returns a finished run's result."""
    calls = []

    def fake_run_local(source, model_def, output, chaos=None, **params):
        calls.append({"source": source, "chaos": chaos, **params})
        return run_result(tmp_path, training_summary())

    monkeypatch.setattr(local_run, "run_local", fake_run_local)
    return calls


ARGS = ["pipeline", "run", "--source", "data.csv", "--model-def", "model.py", "--output", "out"]


def test_stdout_is_the_summary_for_a_person_by_default(stub_pipeline, capsys):
    assert cli.main(ARGS) == 0
    out = capsys.readouterr().out
    assert out.startswith("Pipeline run finished:") and "audit exact" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)


def test_json_puts_the_whole_result_on_stdout(stub_pipeline, capfd, tmp_path):
    assert cli.main([*ARGS, "--json"]) == 0
    captured = capfd.readouterr()
    result = json.loads(captured.out)
    assert result == json.loads(json.dumps(run_result(tmp_path, training_summary())))
    assert "PASSED the gate" in captured.err  # the essentials still reach a person, on stderr


def test_chaos_reaches_the_run_and_a_bad_spec_is_an_error_before_anything_runs(stub_pipeline, capsys, caplog):
    assert cli.main([*ARGS, "--chaos", "kill:worker-0@300000"]) == 0
    assert stub_pipeline[-1]["chaos"] == ["kill:worker-0@300000"]
    assert any("on purpose" in r.getMessage() for r in caplog.records)  # the log says the loss is deliberate
    calls = len(stub_pipeline)
    assert cli.main([*ARGS, "--chaos", "explode:worker-0"]) != 0
    assert "Bad --chaos spec 'explode:worker-0'" in capsys.readouterr().err and len(stub_pipeline) == calls
