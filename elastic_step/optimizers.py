"""The user's Keras optimizer, used where `fit` would use it, with what the two strategies need around it.

Everything the optimizer does in `apply` stays its own: learning-rate schedules (read at its own
`iterations`, which every checkpoint, peer pull and restore carries with its other variables), weight
decay, exponential moving averages (`use_ema`). Three things need help:
  * allreduce scales the learning rate with the membership (`LearningRateScale`): a float rate is
    assigned, a schedule is multiplied, so its decay still follows the optimizer's step count;
  * in `ps` mode the gradient's norm spans every shard, which no shard sees: each worker clips its
    push as the optimizer would (`clip_gradients`), and the shards' copies do not clip again
    (`without_clipping`);
  * a stock Adam runs as TensorFlow's fused kernel (`fused_adam`), wherever the strategies apply the
    optimizer (`updater`): the same arithmetic in one pass over each variable instead of Keras's nine;
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


def fused_adam(optimizer, variables: list):
    """`optimizer.apply(grads, variables)` as TensorFlow's fused kernel (ResourceApplyAdam), one op a variable,
    for a stock Adam already built on `variables` (float32, without constraints); or None for any other
    optimizer, option or variable, which Keras's own `apply` then updates.

    Keras runs Adam's update as nine element-wise ops a variable, each a pass over it and a temporary: on a shard's
    flat variable (the digits CNN's 188k weights) 0.55 ms of wall time and 1.0 ms of CPU a minibatch here, against
    0.05 ms above a bare loop for the kernel. The arithmetic is Keras's (the moments, then the variable by
    `lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)`, epsilon outside the root) but for rounding: the kernel takes
    `1 - beta_2` in float32 (0.00099998713 for 0.999), so the second moment moves 1.3e-5 less, as in TensorFlow's
    own Adam before Keras 3. The state is Keras's: its moments and its `iterations` (which a learning-rate schedule
    reads, and which this step advances), so checkpoints, pulls and restores carry it unchanged."""
    import keras
    import tensorflow as tf

    if type(optimizer) is not keras.optimizers.Adam:  # a subclass may change the update
        return None
    hyper = (optimizer.beta_1, optimizer.beta_2, optimizer.epsilon)
    if (
        optimizer.amsgrad
        or optimizer.weight_decay
        or optimizer.use_ema
        or optimizer.gradient_accumulation_steps
        or optimizer.loss_scale_factor is not None
        or clips(optimizer)
        or not all(isinstance(x, (int, float)) for x in hyper)
        or not variables
        or any(
            tf.as_dtype(v.dtype) != tf.float32
            or getattr(v, "constraint", None) is not None
            or getattr(v, "overwrite_with_gradient", False)
            for v in variables
        )
    ):
        return None
    slots = [(optimizer._momentums[i], optimizer._velocities[i]) for i in map(optimizer._get_variable_index, variables)]

    def handle(v):  # a Keras variable's TensorFlow variable, or a TensorFlow variable's own
        return v.value.handle if isinstance(v, keras.Variable) else v.handle

    def apply(grads):
        beta_1, beta_2, epsilon = (tf.constant(x, tf.float32) for x in hyper)
        step = tf.cast(optimizer.iterations + 1, tf.float32)
        rate = tf.cast(optimizer._get_current_learning_rate(), tf.float32)
        beta_1_power, beta_2_power = tf.pow(beta_1, step), tf.pow(beta_2, step)
        for g, variable, (m, v) in zip(grads, variables, slots):
            tf.raw_ops.ResourceApplyAdam(
                var=handle(variable),
                m=handle(m),
                v=handle(v),
                beta1_power=beta_1_power,
                beta2_power=beta_2_power,
                lr=rate,
                beta1=beta_1,
                beta2=beta_2,
                epsilon=epsilon,
                grad=tf.cast(g, tf.float32),
            )
        optimizer.iterations.assign_add(1)

    return apply


def updater(optimizer, variables: list):
    """The one update of `variables` (the optimizer built on them) by their gradients, in a compiled function:
    Adam's fused kernel where `fused_adam` takes it and every gradient is dense, else Keras's own `apply`."""
    import tensorflow as tf

    fused = fused_adam(optimizer, variables)

    def apply(grads):
        if fused is not None and not any(isinstance(g, tf.IndexedSlices) for g in grads):
            fused(grads)
        elif variables:
            optimizer.apply_gradients(zip(grads, variables))

    return apply


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
