"""Early stopping decides as Keras's EarlyStopping(restore_best_weights=True) does, on the same values."""

from __future__ import annotations

import pytest

from elastic_step.errors import ConfigError
from elastic_step.master.early_stop import EarlyStop

keras = pytest.importorskip("keras")

SEQUENCES = [
    ("loss", [1.0, 0.8, 0.79, 0.81, 0.8, 0.7, 0.9], 2, 0.0),
    ("loss", [1.0, 0.8, 0.79, 0.81, 0.8, 0.7, 0.9], 1, 0.05),
    ("accuracy", [0.5, 0.7, 0.7, 0.69, 0.71, 0.72], 2, 0.0),
    ("accuracy", [0.5, 0.4, 0.3], 0, 0.0),
    ("digit_loss", [2.0, 1.0, 0.5, 0.25], 1, 0.0),
]


def keras_decisions(metric, values, patience, min_delta) -> tuple[int | None, int]:
    """(the epoch fit stops after, or None; the epoch whose weights it restores), from the callback itself."""
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    callback = keras.callbacks.EarlyStopping(
        monitor=f"val_{metric}",
        patience=patience,
        min_delta=min_delta,
        restore_best_weights=True,
        mode="min" if metric.endswith("loss") else "max",  # what ours infers; Keras asks to be told
    )
    model.stop_training = False
    callback.set_model(model)
    callback.on_train_begin()
    for epoch, value in enumerate(values):
        callback.on_epoch_end(epoch, {f"val_{metric}": value})
        if model.stop_training:
            return epoch, callback.best_epoch
    return None, callback.best_epoch


@pytest.mark.parametrize("metric, values, patience, min_delta", SEQUENCES)
def test_it_stops_and_keeps_the_epoch_kerass_early_stopping_does(metric, values, patience, min_delta):
    stop = EarlyStop(metric, patience, min_delta)
    stopped = None
    for epoch, value in enumerate(values):
        if stop.after_epoch(epoch, {metric: value}, lambda epoch=epoch: f"weights of {epoch}"):
            stopped = epoch
            break
    assert (stopped, stop.best_epoch) == keras_decisions(metric, values, patience, min_delta)
    assert stop.best_weights == f"weights of {stop.best_epoch}"


def test_a_metric_the_evaluation_does_not_report_is_named_with_those_it_does():
    with pytest.raises(ConfigError, match=r"'val_loss' is not computed .* \['accuracy', 'loss'\]"):
        EarlyStop("val_loss", 1, 0.0).after_epoch(0, {"epoch": 0, "loss": 1.0, "accuracy": 0.5}, list)
