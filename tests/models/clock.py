"""A model whose trained weights record the learning rate of every update: the witness that a
learning-rate schedule follows the optimizer's own step count (`optimizer.iterations`) across a lost
worker, a rescaled ring and a resume, which owes nothing to the master's ledger.

One Dense unit over a constant input: the loss is minus the mean prediction, so both its weights get
a gradient of -1 at every update. The optimizer moves the bias by 1 and the kernel by the update's
learning rate: after training, the bias is the number of updates applied and the kernel the sum of
their rates. A schedule read at a step count that restarted (a worker or shard that forgot its steps)
would read its early, larger rates again: the kernel would exceed `expected_rates(bias)`.
Data: the tally data set (tests/models/tally.py), its ids unused.
"""

from __future__ import annotations

import keras
import numpy as np

SCHEDULE = {"initial_learning_rate": 1.0, "decay_steps": 40, "decay_rate": 0.5}


def model() -> keras.Model:
    one = keras.Input(shape=(1,), name="one")
    return keras.Model(one, keras.layers.Dense(1, kernel_initializer="zeros", name="clock")(one), name="clock")


def loss(labels, predictions):
    return -keras.ops.mean(predictions)


class Clock(keras.optimizers.Optimizer):
    """The bias counts updates; every other variable adds the update's learning rate."""

    def update_step(self, gradient, variable, learning_rate):
        step = 1.0 if "bias" in variable.name else learning_rate
        gradient = keras.ops.convert_to_tensor(gradient)
        self.assign_sub(variable, keras.ops.cast(step, variable.dtype) * keras.ops.sign(gradient))


def optimizer() -> keras.optimizers.Optimizer:
    return Clock(learning_rate=keras.optimizers.schedules.ExponentialDecay(**SCHEDULE))


def feed(batch: dict[str, np.ndarray]):
    n = len(batch["id"])
    return {"one": np.ones((n, 1), np.float32)}, np.zeros(n, np.float32)


def expected_rates(updates: int, scale: float = 1.0) -> float:
    """The sum of the schedule's rates at steps 0 .. updates-1, each × `scale`."""
    steps = np.arange(updates, dtype=np.float64)
    s = SCHEDULE
    return float(scale * np.sum(s["initial_learning_rate"] * s["decay_rate"] ** (steps / s["decay_steps"])))


def clock(model_path: str) -> tuple[int, float]:
    """(updates applied, the sum of their learning rates), from a saved model."""
    kernel, bias = keras.saving.load_model(model_path, compile=False).get_layer("clock").get_weights()
    return int(round(float(bias[0]))), float(kernel[0, 0])
