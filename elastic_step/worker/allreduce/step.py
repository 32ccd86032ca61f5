"""An allreduce member's step graph: the compiled calls over one flat float32 buffer of the model's trainable
variables (a minibatch's gradient in, the ring's average out), and the kept committed state a run goes back to.

`build_steps` compiles them from the model, the user's loss and the built optimizer alone: no ring, no master,
so a test builds and runs them on a tiny model. The trainer (trainer.py) drives them, under its locks.

A step's average is applied in the same call as the next minibatch's gradient is computed (`lease_steps`), and a
run's later steps go in one call (`run_loop`), because a call's fixed cost is a large share of a small model's
step (docs/benchmarks.md, the sync section). Variables are read after they are updated: automatic control
dependencies order them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from elastic_step.optimizers import updater
from elastic_step.worker.loss_scale import LossScale


@dataclass(frozen=True)
class AllReduceSteps:
    """A member's compiled calls. `size` floats a buffer; `data` is (features, labels[, sample weights]) and
    `begin`/`end` are [lo]/[hi], records of a lease's tensors sliced inside the graph."""

    size: int
    grad_step: Callable  # (data) -> (loss, flat gradient): a minibatch fed on its own
    # by the step applied before it: None (none), False (one, after a run's first), True (a run's first: the state
    # is kept first) -> tf.function([average,] data, begin, end) -> (loss, flat gradient)
    lease_steps: dict
    apply: dict  # keeping first (a run's first step) -> concrete (average) -> None: a step's average on its own
    # (average, data, begin, end, keeping) -> None: the run's steps in one loop, `step_done` called after each
    # step's gradient, handing back (the next average, begin, end, going on)
    run_loop: Callable
    keep: Callable  # () -> None: the weights and optimizer variables into `kept`
    undo: Callable  # () -> None: `kept` back into them
    flat_weights: Callable  # () -> every model weight, flat float32 (for a checksum)
    kept: list  # variables beside the state, of the same shapes: the committed state while a run is applied
    targets: list  # the state: the model's weights, then the optimizer's variables


def build_steps(
    model_def, model, optimizer, step_done: Callable, loss_scaling: tuple[float, int] | None = None
) -> AllReduceSteps:
    """The compiled calls of a member training `model` with `optimizer` (built on its trainable variables).
    `step_done(loss, flat)`: `run_loop`'s callback (numpy in and out, on one of TensorFlow's threads) after each
    step's gradient: (next average float32 [size], begin int64 [1], end int64 [1], going on bool).
    `loss_scaling`: (initial scale, growth steps) of the member's dynamic loss scaling (ModelDef.loss_scaling), or
    None."""
    import tensorflow as tf

    trainable = model.trainable_variables
    sizes = [int(v.shape.num_elements()) for v in trainable]
    size = sum(sizes)
    loss_scale = None if loss_scaling is None else LossScale(*loss_scaling)
    loss_and_gradient = _loss_and_gradient(model_def, model, loss_scale)
    apply_mean = _mean_applier(updater(optimizer, trainable), trainable, sizes, loss_scale is not None)

    def sliced(data, begin, end):
        # One op per tensor: `begin`/`end` are [lo]/[hi], the other dimensions taken whole.
        return tf.nest.map_structure(lambda t: tf.strided_slice(t, begin, end), data)

    targets = [*model.weights, *optimizer.variables]
    kept = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in targets]

    def keep():
        for k, v in zip(kept, targets):
            k.assign(v)  # read before any update after it (automatic control dependencies order them)

    def undo():
        for k, v in zip(kept, targets):
            v.assign(k)

    def flat_weights():
        return tf.concat([tf.reshape(tf.cast(v, tf.float32), [-1]) for v in model.weights], 0)

    def lease_step(data, begin, end):
        return loss_and_gradient(sliced(data, begin, end))

    def lease_step_after(keeping):
        def step(flat, data, begin, end):
            if keeping:
                keep()
            apply_mean(flat)
            return loss_and_gradient(sliced(data, begin, end))

        return tf.function(step)

    def applying(keeping):
        def apply(flat):
            if keeping:
                keep()
            apply_mean(flat)

        # Concrete: a call skips matching its arguments against traces.
        return tf.function(apply).get_concrete_function(tf.TensorSpec([size], tf.float32))

    return AllReduceSteps(
        size=size,
        grad_step=tf.function(loss_and_gradient, reduce_retracing=True),
        lease_steps={None: tf.function(lease_step), **{k: lease_step_after(k) for k in (False, True)}},
        apply={keeping: applying(keeping) for keeping in (False, True)},
        run_loop=_run_loop(size, keep, apply_mean, lease_step, step_done),
        keep=tf.function(keep),
        undo=tf.function(undo),
        flat_weights=tf.function(flat_weights),
        kept=kept,
        targets=targets,
    )


def _mean_applier(update: Callable, trainable, sizes: list[int], loss_scaled: bool) -> Callable:
    """`apply_mean(flat)`: the ring's average gradient, split back into the trainable variables' shapes, applied."""
    import tensorflow as tf

    def update_mean(flat):
        update([tf.cast(tf.reshape(p, v.shape), v.dtype) for p, v in zip(tf.split(flat, sizes), trainable)])
        return tf.constant(True)

    def apply_mean(flat):
        if not loss_scaled:
            update_mean(flat)
            return
        # Under loss scaling, a member whose gradient overflowed sends it into the ring as it is, so the average
        # is not finite on every member alike: all skip the step, as Keras's LossScaleOptimizer skips it. The
        # scale is each member's own (its contribution is unscaled): one that overflowed has lowered its own.
        tf.cond(tf.reduce_all(tf.math.is_finite(flat)), lambda: update_mean(flat), lambda: tf.constant(False))

    return apply_mean


def _run_loop(size: int, keep, apply_mean, lease_step, step_done: Callable):
    """A run's steps in one call: apply the average, compute the next minibatch's gradient (`lease_step`), hand it
    to `step_done`, which hands back the next average and bounds, until it says stop."""
    import tensorflow as tf

    def run_loop(flat, data, begin, end, keeping):
        if keeping:  # the loop's first apply is the run's first: what it is applied to is kept first
            keep()

        def body(flat, begin, end, going):
            apply_mean(flat)
            loss, grad = lease_step(data, begin, end)
            flat, begin, end, going = tf.numpy_function(
                step_done, [loss, grad], [tf.float32, tf.int64, tf.int64, tf.bool], stateful=True
            )
            flat.set_shape([size])
            begin.set_shape([1])
            end.set_shape([1])
            going.set_shape([])
            return flat, begin, end, going

        tf.while_loop(lambda *loop: loop[-1], body, [flat, begin, end, tf.constant(True)])

    return tf.function(run_loop)


def _loss_and_gradient(model_def, model, loss_scale: LossScale | None):
    """(data) -> (the user's loss, its gradient as one flat float32 buffer; zeros where a variable has none). Under
    loss scaling, the gradient of the scaled loss, unscaled, and the member's scale updated after it."""
    import tensorflow as tf

    trainable = model.trainable_variables

    def loss_and_gradient(data):
        features, labels, *weights = data  # (features, labels[, sample weights])
        with tf.GradientTape() as tape:
            loss = model_def.training_loss(model, features, labels, *weights)
            scaled = loss if loss_scale is None else loss_scale.scaled(loss)
        grads = tape.gradient(scaled, trainable)
        if loss_scale is not None:
            grads = loss_scale.unscaled(grads)
            loss_scale.update(loss_scale.finite(grads))
        flat = tf.concat(
            [
                tf.reshape(tf.cast(tf.zeros_like(v) if g is None else tf.convert_to_tensor(g), tf.float32), [-1])
                for g, v in zip(grads, trainable)
            ],
            0,
        )
        return loss, flat

    return loss_and_gradient
