"""The PS worker's step graph: the compiled calls that turn a lease's tensors and the shards' flat dense values
into a loss and what a push carries (one flat gradient buffer per shard, each embedding table's touched rows).

`build_steps` compiles them from the model, the user's loss and the placement alone: no PS client, no thread,
nothing of the worker's state, so a test builds and runs them on a tiny model. The trainer (trainer.py) feeds
them values and pushes what they return.

The step takes each shard's flat dense values as inputs (Keras's stateless_call) instead of reading the model's
variables: taking fresh values is swapping a reference, and no assignment competes with the step for
TensorFlow's threads. The minibatch is sliced from its lease's tensors inside the graph: no Python per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from elastic_step.optimizers import clip_gradients, clips
from elastic_step.ps.api import Placement, state_variables, variable_names
from elastic_step.ps.server import ParameterShard
from elastic_step.worker.loss_scale import LossScale

# A copy's state (values and optimizer slots: Adam's are 3x the model) rides in each push only up to this size:
# beyond it the shared slots would hold more than the model several times over, in /dev/shm.
MAX_STATE_BYTES = 64 << 20


@dataclass(frozen=True)
class PSSteps:
    """The compiled calls of a PS worker, each traced once per input structure."""

    # (data, begin [lo], end [hi], each shard's flat values) -> (loss, each shard's flat gradient, each table's
    # (unique ids, summed rows)): one minibatch, or with minibatches_per_push > 1 a group of them at the same values,
    # the mean of their gradients pushed once (as Keras's gradient_accumulation_steps applies it).
    step: Callable
    # (data, begins, ends) -> (each minibatch's loss, per shard its flat gradients [minibatches, floats], per shard
    # the copy's state after the call when pushes carry it, whether each minibatch is finite): several minibatches
    # in one call on the worker's copies of the shards, each copy updated after each. None without copies.
    copies_step: Callable | None
    copies: list  # the worker's copies of the shards (ps/server.py's ParameterShard, not served), one per shard
    copies_carry_state: bool  # copies_step returns each copy's state after the call
    flat_specs: list  # each shard's flat values, as the step's input spec
    loss_scale: LossScale | None = None  # the worker's dynamic loss scaling, which the steps update, or None


class StepGraph:
    """The pieces every step is made of, over the placement's layout of the model's variables: each shard's flat
    buffer holds, in order, ("weight", position in trainable) or ("state", position in the non-trainable
    variables). A push carries the weights' gradients and how the step changed the state."""

    def __init__(self, model_def, model, placement: Placement, loss_scale: LossScale | None = None):
        import tensorflow as tf

        self.tf, self.model_def, self.model = tf, model_def, model
        self.loss_scale = loss_scale  # the worker's own (worker/loss_scale.py), or None
        names = variable_names(model)
        self.trainable = model.trainable_variables
        self.state_vars = model.non_trainable_variables
        where = {
            **{n: ("weight", i) for i, n in enumerate(names)},
            **{n: ("state", i) for n, i in state_variables(model)},
        }
        self.layouts = [[where[n] for n in placement.dense_on(s)] for s in range(placement.num_ps)]
        self.table_pos = [names.index(n) for n in names if n in placement.embeddings]
        self.dense_pos = [i for i in range(len(self.trainable)) if i not in self.table_pos]
        self.part_sizes = [[int(self._var(*at).shape.num_elements()) for at in layout] for layout in self.layouts]
        self.clipper = model_def.optimizer()  # its clipping options: the shards' copies do not clip

    def _var(self, kind, i):
        return self.trainable[i] if kind == "weight" else self.state_vars[i]

    def flat_specs(self) -> list:
        return [self.tf.TensorSpec([sum(sizes)], self.tf.float32) for sizes in self.part_sizes]

    def flat(self, tensors_):
        tf = self.tf
        if not tensors_:
            return tf.zeros([0], tf.float32)
        return tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors_], 0)

    def unpack(self, flats):
        """Each trainable's value and each pushed state's, from the shards' flat buffers."""
        tf = self.tf
        values, state = [None] * len(self.trainable), {}
        for layout, sizes, buf in zip(self.layouts, self.part_sizes, flats):
            for (kind, i), part in zip(layout, tf.split(buf, sizes) if layout else []):
                v = self._var(kind, i)
                value = tf.cast(tf.reshape(part, v.shape), v.dtype)
                if kind == "weight":
                    values[i] = value
                else:
                    state[i] = value
        for i in self.table_pos:  # tables stay variables: the rows a minibatch needs are pulled into them
            values[i] = tf.convert_to_tensor(self.trainable[i].value)
        return values, state

    def dense_grad(self, g, i):
        tf = self.tf
        return tf.zeros_like(self.trainable[i]) if g is None else tf.convert_to_tensor(g)

    def table_grad(self, g, i):
        """A table's gradient as (ids, rows): only the rows it touched."""
        tf = self.tf
        if g is None:
            return tf.zeros([0], tf.int64), tf.zeros([0, self.trainable[i].shape[1]], self.trainable[i].dtype)
        if not isinstance(g, tf.IndexedSlices):  # a dense gradient of a table: keep touched rows
            rows = tf.where(tf.reduce_any(tf.not_equal(g, 0), axis=1))[:, 0]
            return rows, tf.gather(g, rows)
        return tf.cast(g.indices, tf.int64), g.values

    def pack(self, grads, state_delta, tables):
        """One flat buffer per PS shard (one tensor on the wire instead of one per variable), and each table's
        unique ids with their summed rows, clipped as the user's optimizer clips a step's gradients (a table's by
        the rows it touched: the rest of its gradient is zeros)."""
        tf = self.tf
        sparse = []
        for ids, rows in tables:
            ids, pos = tf.unique(ids)
            sparse.append((ids, tf.math.unsorted_segment_sum(rows, pos, tf.size(ids))))
        grads = {i: self.dense_grad(grads[i], i) for i in self.dense_pos}
        if clips(self.clipper):
            clipped = clip_gradients(self.clipper, [grads[i] for i in self.dense_pos] + [rows for _, rows in sparse])
            grads = dict(zip(self.dense_pos, clipped))
            sparse = [(ids, rows) for (ids, _), rows in zip(sparse, clipped[len(self.dense_pos) :])]
        dense = [
            self.flat([state_delta[i] if kind == "state" else grads[i] for kind, i in layout])
            for layout in self.layouts
        ]
        return dense, sparse

    def gradients(self, data, lo, hi, values, state):
        """Loss, gradients and new state of records [lo, hi) of the lease's tensors: `data` is (features, labels)
        or (features, labels, sample weights). Under loss scaling the gradients are taken of the scaled loss and
        unscaled; the scale is not updated here (`scale_after`)."""
        tf = self.tf
        # One op per tensor: `lo`/`hi` are [lo]/[hi], the other dimensions taken whole.
        features, labels, *weights = tf.nest.map_structure(lambda t: tf.strided_slice(t, lo, hi), data)
        with tf.GradientTape() as tape:
            tape.watch(values)
            loss, new_state = self.model_def.training_loss(
                self.model, features, labels, *weights, trainable_values=values, state_values=state
            )
            scaled = loss if self.loss_scale is None else self.loss_scale.scaled(loss)
        grads = tape.gradient(scaled, values)
        return loss, (grads if self.loss_scale is None else self.loss_scale.unscaled(grads)), new_state

    def scale_after(self, grads) -> None:
        """Under loss scaling, the worker's scale updated after a step's (unscaled) gradients."""
        if self.loss_scale is not None:
            self.loss_scale.update(self.loss_scale.finite(grads))


def build_steps(
    model_def,
    model,
    placement: Placement,
    *,
    minibatch_size: int = 64,
    minibatches_per_push: int = 1,
    on_copies: bool = False,
    skip_non_finite: bool = False,
    state_may_ride: bool = False,
    loss_scaling: tuple[float, int] | None = None,
) -> PSSteps:
    """The PS worker's compiled calls. `on_copies`: with copies of the shards, to run several minibatches a call on;
    `skip_non_finite`: a minibatch that is not finite leaves the copies as they were; `state_may_ride`: a push may
    carry a copy's state (the shards are on this host), which it then does unless the state exceeds
    MAX_STATE_BYTES; `loss_scaling`: (initial scale, growth steps) of the worker's dynamic loss scaling
    (ModelDef.loss_scaling), or None."""
    graph = StepGraph(model_def, model, placement, None if loss_scaling is None else LossScale(*loss_scaling))
    step = _one_step(graph) if minibatches_per_push == 1 else _group_step(graph, minibatch_size)
    copies = (
        [ParameterShard(model, model_def.optimizer(), placement, s, serve=False) for s in range(placement.num_ps)]
        if on_copies
        else []
    )
    # On one host a call's push also carries the copies' state after it, which a shard still at the state the
    # call started from takes instead of running the same updates again (ParameterShard.push_many): the shard's
    # update competes with the worker's step for the cores only there.
    carry = bool(copies) and state_may_ride and all(0 < c.state_words * 4 <= MAX_STATE_BYTES for c in copies)
    # Under loss scaling a step that overflowed leaves the copies as they were, as it leaves the shards.
    skip = skip_non_finite or loss_scaling is not None
    copies_step = _copies_step(graph, copies, skip, carry) if copies else None
    return PSSteps(step, copies_step, copies, carry, graph.flat_specs(), graph.loss_scale)


def _one_step(g: StepGraph):
    tf = g.tf

    @tf.function(reduce_retracing=True)
    def step(data, begin, end, flats):
        values, state = g.unpack(flats)
        loss, grads, new_state = g.gradients(data, begin, end, values, state)
        g.scale_after(grads)
        tables = [g.table_grad(grads[i], i) for i in g.table_pos]
        return (loss, *g.pack(grads, {i: new_state[i] - state[i] for i in state}, tables))

    return step


def _group_step(g: StepGraph, minibatch_size: int):
    tf, trainable = g.tf, g.trainable

    @tf.function(reduce_retracing=True)
    def group_step(data, begin, end, flats):
        # Several minibatches at the same values, one after another (each minibatch_size records, the last maybe
        # fewer), in one call. The state (batch norm's statistics) runs on from one minibatch to the next.
        values, state = g.unpack(flats)
        n = tf.cast((end[0] - begin[0] + minibatch_size - 1) // minibatch_size, tf.int32)
        tas = [
            (
                tf.TensorArray(tf.int64, size=n, infer_shape=False),
                tf.TensorArray(trainable[i].dtype, size=n, infer_shape=False),
            )
            for i in g.table_pos
        ]

        def body(k, loss_sum, sums, state_k, tas):
            lo = begin + tf.cast(k, tf.int64) * minibatch_size
            loss, grads, new_state = g.gradients(data, lo, tf.minimum(lo + minibatch_size, end), values, state_k)
            sums = [s + g.dense_grad(grads[i], i) for s, i in zip(sums, g.dense_pos)]
            tas = [
                (ids_ta.write(k, ids), rows_ta.write(k, rows))
                for (ids_ta, rows_ta), (ids, rows) in zip(tas, (g.table_grad(grads[i], i) for i in g.table_pos))
            ]
            return k + 1, loss_sum + tf.cast(loss, tf.float32), sums, new_state, tas

        _, loss_sum, sums, last_state, tas = tf.while_loop(
            lambda k, *_: k < n,
            body,
            (tf.constant(0), tf.constant(0.0), [tf.zeros_like(trainable[i]) for i in g.dense_pos], state, tas),
        )
        count = tf.cast(n, tf.float32)
        grads = [None] * len(trainable)
        for s, i in zip(sums, g.dense_pos):
            grads[i] = s / tf.cast(count, s.dtype)
        tables = [
            (ids_ta.concat(), rows_ta.concat() / tf.cast(count, trainable[i].dtype))
            for (ids_ta, rows_ta), i in zip(tas, g.table_pos)
        ]
        # Under loss scaling the group is one step: skipped as a whole when any of its minibatches overflowed.
        g.scale_after([grads[i] for i in g.dense_pos] + [rows for _, rows in tables])
        return (loss_sum / count, *g.pack(grads, {i: last_state[i] - state[i] for i in state}, tables))

    return group_step


def _copies_step(g: StepGraph, copies: list, skip: bool, words: bool):
    tf = g.tf

    def copies_step(data, begins, ends):
        # Minibatch k is [begins[k], ends[k]) of the lease's tensors; each is a step on the copies' current values,
        # and the shard's update of the copies with its gradient (unless not finite, when skipping). Whether each
        # one is finite is returned, so the push thread reads the gradients only when they are sent.
        n = tf.size(begins)
        losses = tf.TensorArray(tf.float32, size=n)
        finites = tf.TensorArray(tf.bool, size=n)
        grads_tas = [tf.TensorArray(tf.float32, size=n, element_shape=[c.dense_size]) for c in copies]

        def body(k, flats, losses, finites, grads_tas):
            values, state = g.unpack(flats)
            loss, grads, new_state = g.gradients(data, begins[k][None], ends[k][None], values, state)
            dense, _ = g.pack(grads, {i: new_state[i] - state[i] for i in state}, [])
            loss = tf.cast(loss, tf.float32)
            finite = tf.reduce_all([tf.math.is_finite(loss)] + [tf.reduce_all(tf.math.is_finite(d)) for d in dense])
            if g.loss_scale is not None:
                g.loss_scale.update(finite)
            if skip:
                flats = [
                    tf.cond(finite, lambda c=c, d=d: c.update(d), lambda f=f: f)
                    for c, d, f in zip(copies, dense, flats)
                ]
            else:
                flats = [c.update(d) for c, d in zip(copies, dense)]
            grads_tas = [ta.write(k, d) for ta, d in zip(grads_tas, dense)]
            return k + 1, flats, losses.write(k, loss), finites.write(k, finite), grads_tas

        _, _, losses, finites, grads_tas = tf.while_loop(
            lambda k, *_: k < n,
            body,
            (tf.constant(0), [c.values() for c in copies], losses, finites, grads_tas),
        )
        states = [c.words() for c in copies] if words else []
        return losses.stack(), [ta.stack() for ta in grads_tas], states, finites.stack()

    return tf.function(copies_step)
