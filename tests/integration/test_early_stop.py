"""Early stopping as a job parameter: a job whose evaluation stops improving ends before its last epoch, with the
best epoch's weights, and the ledger and the audit exact for the epochs that ran; as `fit` with Keras's
EarlyStopping(restore_best_weights=True) trains the same module."""

from __future__ import annotations

import textwrap

import pytest

from elastic_step.data.reader import read_all
from tests.integration.harness import DIGITS_MODEL, train
from tests.parity.test_keras_parity import TOLERANCE, load_module

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


def fit_with_early_stopping(path: str, data: dict) -> tuple[int, int, dict]:
    """The module under `fit` with EarlyStopping(restore_best_weights=True) on the eval data, as the job is
    configured: (the best epoch, the epoch it stopped after, `evaluate` of the weights it kept)."""
    import keras

    keras.utils.set_random_seed(0)
    module = load_module(path)
    x, y = module.feed(read_all(data["train"]))
    eval_x, eval_y = module.feed(read_all(data["eval"]))
    net = module.model()
    net.compile(optimizer=module.optimizer(), loss=module.loss, metrics=list(module.eval_metrics().values()))
    stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True)
    net.fit(x, y, validation_data=(eval_x, eval_y), epochs=6, batch_size=32, callbacks=[stop], verbose=0)
    return stop.best_epoch, stop.stopped_epoch, net.evaluate(eval_x, eval_y, verbose=0, return_dict=True)


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
    # As fit with EarlyStopping(restore_best_weights=True) trains the same module: the same epochs, its evaluation.
    best, stopped, evaluation = fit_with_early_stopping(str(model), digits_data)
    assert (stop["best_epoch"], stop["stopped_epoch"]) == (best, stopped)
    tolerance = TOLERANCE["digits_data"]
    assert all(abs(summary["eval"][m] - evaluation[m]) <= tolerance[m] for m in tolerance), (
        summary["eval"],
        evaluation,
    )
