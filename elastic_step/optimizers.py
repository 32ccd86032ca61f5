"""The user's Keras optimizer, used where `fit` would use it, with what the two strategies need around it.

Everything the optimizer does in `apply` stays its own: learning-rate schedules (read at its own
`iterations`, which every checkpoint, peer pull and restore carries with its other variables), weight
decay, exponential moving averages (`use_ema`). Three things need help:
  * allreduce scales the learning rate with the membership (`LearningRateScale`): a float rate is
    assigned, a schedule is multiplied, so its decay still follows the optimizer's step count;
  * in `ps` mode the gradient's norm spans every shard, which no shard sees: each worker clips its
    push as the optimizer would (`clip_gradients`), and the shards' copies do not clip again
    (`without_clipping`);
  * the final model holds the moving averages when the optimizer keeps them, as after `fit`
    (`finalize`: Keras's `finalize_variable_values`).
"""

from __future__ import annotations

import numpy as np

CLIP_OPTIONS = ("clipnorm", "global_clipnorm", "clipvalue")


def clips(optimizer) -> bool:
    return any(getattr(optimizer, option, None) for option in CLIP_OPTIONS)


def clip_gradients(optimizer, grads: list) -> list:
    """`grads` clipped exactly as `optimizer.apply` clips them (clipnorm per tensor, global_clipnorm
    over all of them, clipvalue per element), by Keras's own code. In a compiled function."""
    return list(optimizer._clip_gradients(list(grads))) if clips(optimizer) else list(grads)


def without_clipping(optimizer):
    """The optimizer with its clipping options cleared, for gradients already clipped."""
    for option in CLIP_OPTIONS:
        setattr(optimizer, option, None)
    return optimizer


class LearningRateScale:
    """Multiplies an optimizer's learning rate, a float or a schedule, by a factor set before each apply.

    A float rate lives in the optimizer's `learning_rate` variable (part of its state): the factor
    times the rate `optimizer()` gave is assigned to it. A schedule (or a callable rate) has no
    variable: the optimizer's rate becomes `schedule(iterations) × factor`, the factor a variable
    that the compiled apply reads, so the schedule still follows the optimizer's own step count."""

    def __init__(self, optimizer):
        import keras
        import tensorflow as tf

        rate = optimizer._learning_rate
        self._variable, self._base, self._factor = None, None, None
        if isinstance(rate, keras.Variable):
            self._variable, self._base = rate, float(np.asarray(rate.numpy()))
            return
        factor = self._factor = tf.Variable(1.0, trainable=False, dtype=tf.float32, name="learning_rate_factor")
        is_schedule = isinstance(rate, keras.optimizers.schedules.LearningRateSchedule)

        def scaled():
            base = tf.convert_to_tensor(rate(optimizer.iterations) if is_schedule else rate())
            return base * tf.cast(factor, base.dtype)

        optimizer.learning_rate = scaled

    def set(self, factor: float) -> None:
        if self._variable is not None:
            self._variable.assign(self._base * factor)
        else:
            self._factor.assign(factor)


def moving_averages(optimizer, variables: list) -> list | None:
    """The optimizer's moving average of each of `variables` (use_ema), or None when it keeps none."""
    if not getattr(optimizer, "use_ema", False):
        return None
    averages = optimizer._model_variables_moving_average
    return [averages[optimizer._get_variable_index(v)] for v in variables]


def finalize(model, optimizer, optimizer_values: list[np.ndarray]) -> None:
    """The model's final values from its optimizer's state (`optimizer_values`, in the order of
    `optimizer.variables` once built on the model's trainable variables): with `use_ema`, the moving
    averages replace the weights, as `fit` leaves them (finalize_variable_values). Else nothing."""
    if not getattr(optimizer, "use_ema", False):
        return
    optimizer.build(model.trainable_variables)
    targets = optimizer.variables
    if len(targets) != len(optimizer_values):
        raise ValueError(
            f"the optimizer state has {len(optimizer_values)} variables; this model's optimizer has {len(targets)}"
        )
    for var, value in zip(targets, optimizer_values):
        var.assign(np.asarray(value).reshape(tuple(var.shape)))
    optimizer.finalize_variable_values(model.trainable_variables)
