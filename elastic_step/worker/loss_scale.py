"""Keras's dynamic loss scaling (its LossScaleOptimizer) in a worker's own steps: what `fit` does for a model whose
dtype policy is mixed_float16 (compile wraps its optimizer in one) or whose optimizer() returns one.

The loss is multiplied by the scale before the gradient is taken, so that float16's small intermediate gradients
do not underflow, and the gradient is divided by it right after: what leaves the worker (a push to the shards, a
contribution to the ring) is the true gradient, in float32. A step whose gradient is not finite at that scale is
skipped and the scale halved; after `growth_steps` finite steps in a row it doubles: Keras's rule, step for step.
A skipped step has consumed its batch, as in `fit`: its records count as trained, and it is not a non-finite
failure. A loss that is not finite still is one, as Keras's TerminateOnNaN stops `fit` on it.

The scale is each worker's own, as TensorFlow's parameter-server training keeps it per worker: the gradients it
sends are unscaled, so workers (or ring members) at different scales still add up, and a relaunched worker or a
newcomer simply starts at the initial scale. Nor does it travel with the model's state (a checkpoint, a peer's
pull, an aborted allreduce run's undo): it only decides which steps overflow, and re-learns its level in a few.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def overflowed(loss: float, gradients: Sequence[np.ndarray]) -> bool:
    """Whether a step under loss scaling is one the scaling skips: a finite loss, a gradient that is not."""
    return math.isfinite(loss) and not all(np.isfinite(g).all() for g in gradients)


class LossScale:
    """The scale and its count of finite steps, as variables the compiled steps read and update."""

    def __init__(self, initial_scale: float, growth_steps: int):
        import tensorflow as tf

        self.tf = tf
        self.growth_steps = growth_steps
        self.scale = tf.Variable(initial_scale, trainable=False, dtype=tf.float32, name="loss_scale")
        self.good_steps = tf.Variable(0, trainable=False, dtype=tf.int64, name="loss_scale_good_steps")

    def values(self) -> tuple:
        return self.scale.numpy(), self.good_steps.numpy()

    def load(self, values: tuple) -> None:
        self.scale.assign(values[0])
        self.good_steps.assign(values[1])

    def scaled(self, loss):
        return loss * self.tf.cast(self.scale, loss.dtype)

    def unscaled(self, gradients: list) -> list:
        """Each gradient (None, a tensor, or an embedding table's IndexedSlices) divided by the scale."""
        tf = self.tf

        def divided(g):
            if g is None:
                return None
            if isinstance(g, tf.IndexedSlices):
                return tf.IndexedSlices(g.values / tf.cast(self.scale, g.values.dtype), g.indices, g.dense_shape)
            return g / tf.cast(self.scale, g.dtype)

        return [divided(g) for g in gradients]

    def finite(self, gradients: list):
        """Whether every gradient is finite, as a boolean tensor."""
        tf = self.tf
        parts = [g.values if isinstance(g, tf.IndexedSlices) else g for g in gradients if g is not None]
        return tf.reduce_all([tf.reduce_all(tf.math.is_finite(p)) for p in parts]) if parts else tf.constant(True)

    def update(self, finite) -> None:
        """After a step's gradient (unscaled at the scale it was taken at): halve on a step that is not finite,
        double after `growth_steps` finite ones, as LossScaleOptimizer.apply does."""
        tf = self.tf

        def grow_or_count():
            grow = tf.equal(self.good_steps, self.growth_steps - 1)
            self.scale.assign(tf.where(grow, self.scale * 2.0, self.scale))
            self.good_steps.assign(tf.where(grow, tf.constant(0, tf.int64), self.good_steps + 1))
            return tf.constant(True)

        def lower():
            self.scale.assign(self.scale * 0.5)
            self.good_steps.assign(0)
            return tf.constant(False)

        tf.cond(finite, grow_or_count, lower)
