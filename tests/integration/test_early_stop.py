"""Early stopping as a job parameter: a job whose evaluation stops improving ends before its last epoch, with the
best epoch's weights, and the ledger and the audit exact for the epochs that ran."""

from __future__ import annotations

import textwrap

import pytest

from tests.integration.harness import DIGITS_MODEL, train

# The digits sample, trained by descent for the first epoch (45 minibatches of 32) and by ascent after it: the
# evaluation is best after epoch 1 and worse after every later one.
WORSENS_AFTER_EPOCH_1 = textwrap.dedent("""
    class DescentThenAscent(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return keras.ops.where(step < 45, 0.1, -0.005)

        def get_config(self):
            return {}

    def optimizer():
        return keras.optimizers.SGD(learning_rate=DescentThenAscent())
""")


@pytest.mark.parametrize("strategy", ["ps", "allreduce"])
def test_a_job_whose_evaluation_stops_improving_ends_with_its_best_epoch(tmp_path, digits_data, strategy):
    model = tmp_path / "worsens.py"
    model.write_text(open(DIGITS_MODEL).read() + WORSENS_AFTER_EPOCH_1)
    proc, summary = train(
        digits_data,
        tmp_path / "out",
        model=str(model),
        strategy=strategy,
        min_workers=1,
        max_workers=1,
        minibatch_size=32,
        epochs=6,
        early_stop_metric="loss",
        early_stop_patience=2,
        checkpoint_every=0,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    stop = summary["early_stop"]
    # Epoch 1 (0 here) is the best; two epochs without improvement end training after the third.
    assert stop["best_epoch"] == 0 and stop["stopped_epoch"] == 2, stop
    assert "did not improve" in stop["reason"] and summary["epochs_ran"] == 3
    # The ledger and the audit: every record once in each of the 3 epochs that ran, none of a fourth.
    epochs = summary["ledger"]["epochs"]
    assert [e["committed"] for e in epochs] == [summary["records_per_epoch"]] * 3, epochs
    assert summary["audit"]["verdict"] == "exact" and len(summary["audit"]["epochs"]) == 3, summary["audit"]
    # The published model is the best epoch's: it evaluates as that epoch's point did, not as the last one's.
    points = {p["epoch"]: p for p in summary["eval_history"]}
    assert sorted(e for e in points if e >= 0) == [0, 1, 2]
    assert summary["eval"]["loss"] == pytest.approx(points[0]["loss"], abs=1e-4)
    assert points[2]["loss"] > points[0]["loss"] + 1e-3
    assert "early stopping after epoch 2" in proc.stderr
