"""Asynchronous SGD against parameter servers: pull, compute gradients with a GradientTape
in a compiled function, push keyed by (task, minibatch), take the fresh dense values back.

Embedding tables stay whole in the worker's model but only the rows a minibatch looks up are
pulled before the step, and only those rows' gradients are pushed, to their owning shards.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from elastic_step.errors import ModelDefError
from elastic_step.ps.api import Placement, embedding_variable_paths, variable_names
from elastic_step.ps.client import PSClient

log = logging.getLogger("elastic_step.worker")


class PSTrainer:
    def __init__(self, model_def, model, ps: PSClient, placement: Placement):
        import keras
        import tensorflow as tf

        self.tf = tf
        self.model_def = model_def
        self.model = model
        self.ps = ps
        self.placement = placement
        self.names = variable_names(model)
        self.variables = dict(zip(self.names, model.trainable_variables))
        self.table_names = [n for n in self.names if n in placement.embeddings]
        self._ids_of = self._id_extractor(keras, model)
        loss_fn = model_def.loss_fn
        trainable = model.trainable_variables
        shard_pos = [[self.names.index(n) for n in placement.dense_on(s)] for s in range(placement.num_ps)]
        table_pos = [self.names.index(n) for n in self.table_names]

        def flat(tensors_):
            if not tensors_:
                return tf.zeros([0], tf.float32)
            return tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors_], 0)

        @tf.function(reduce_retracing=True)
        def step(features, labels):
            with tf.GradientTape() as tape:
                predictions = model(features, training=True)
                loss = loss_fn(labels, predictions)
                if model.losses:
                    loss = loss + tf.add_n(model.losses)
            grads = tape.gradient(loss, trainable)
            # One flat buffer per PS shard: one tensor on the wire instead of one per variable.
            dense = [flat([tf.zeros_like(trainable[i]) if grads[i] is None else tf.convert_to_tensor(grads[i])
                           for i in pos]) for pos in shard_pos]
            sparse = []
            for i in table_pos:
                g = grads[i]
                if g is None:
                    g = tf.IndexedSlices(tf.zeros([0, trainable[i].shape[1]], trainable[i].dtype),
                                         tf.zeros([0], tf.int64))
                elif not isinstance(g, tf.IndexedSlices):  # a dense gradient of a table: keep touched rows
                    rows = tf.where(tf.reduce_any(tf.not_equal(g, 0), axis=1))[:, 0]
                    g = tf.IndexedSlices(tf.gather(g, rows), rows)
                ids, pos = tf.unique(tf.cast(g.indices, tf.int64))
                sparse.append((ids, tf.math.unsorted_segment_sum(g.values, pos, tf.size(ids))))
            return loss, dense, sparse

        self._step = step
        shard_vars = [[trainable[i] for i in pos] for pos in shard_pos]

        sizes = [sum(int(v.shape.num_elements()) for v in vs) for vs in shard_vars]

        # A fixed signature: the call skips the per-call trace-type matching of generic arguments.
        @tf.function(input_signature=[[tf.TensorSpec([n], tf.float32) for n in sizes]])
        def assign_dense(flats):  # one compiled call: split each shard's buffer into its variables
            for variables, buf in zip(shard_vars, flats):
                if variables:
                    parts = tf.split(buf, [int(v.shape.num_elements()) for v in variables])
                    for var, part in zip(variables, parts):
                        var.assign(tf.cast(tf.reshape(part, var.shape), var.dtype))

        self._assign_dense = assign_dense
        self._versions = [-1] * placement.num_ps

    @staticmethod
    def _id_extractor(keras, model):
        """A sub-model giving each embedding layer's input ids, so rows are pulled before the step.

        Works for functional models; for subclassed ones rows are refreshed after each push
        instead (one step staler), which async SGD tolerates.
        """
        paths = embedding_variable_paths(model)
        layers = [l for l in model._flatten_layers(include_self=False)
                  if isinstance(l, keras.layers.Embedding) and l.embeddings.path in paths]
        if not layers:
            return None
        try:
            return keras.Model(model.inputs, [l.input for l in layers]), [l.embeddings.path for l in layers]
        except Exception:  # noqa: BLE001 - not a functional graph
            log.info("model is not functional: embedding rows are refreshed after each push")
            return None

    def set_dense(self, flats: list[np.ndarray]) -> None:
        """Load each shard's flat dense buffer into the model."""
        self._assign_dense(flats)

    def _set_rows(self, rows: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        tf = self.tf
        for name, (ids, values) in rows.items():
            # .value is the backing tf.Variable: update just these rows, not the whole table
            self.variables[name].value.scatter_update(tf.IndexedSlices(values, ids))

    def _pull_rows_for(self, features) -> None:
        extractor, paths = self._ids_of
        outs = extractor(features, training=False)
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        path_to_name = {v.path: n for n, v in self.variables.items()}
        wanted: dict[str, list[np.ndarray]] = {}
        for path, ids in zip(paths, outs):
            wanted.setdefault(path_to_name[path], []).append(np.asarray(ids).astype(np.int64).ravel())
        lookups = {n: np.unique(np.concatenate(v)) for n, v in wanted.items()}
        pulled = self.ps.pull_rows(lookups)
        self._set_rows({n: (lookups[n], pulled[n]) for n in lookups})

    def compute(self, batch: dict[str, np.ndarray]) -> Gradients:
        """Gradients of one minibatch at the worker's current parameters."""
        features, labels = self.model_def.feed(batch)
        if self.table_names and self._ids_of is not None:
            self._pull_rows_for(features)
        try:
            loss, dense, sparse = self._step(features, labels)
        except Exception as e:  # the user's model/loss failed on real data
            first = str(e).splitlines()[0] if str(e) else ""
            raise ModelDefError(f"The training step of the model definition {self.model_def.spec!r} raised "
                                f"{type(e).__name__}: {first}. Check that feed() returns what model() and "
                                "loss() expect.") from e
        return Gradients(loss=float(loss), dense=[g.numpy() for g in dense],
                         rows={n: (ids.numpy(), v.numpy()) for n, (ids, v) in zip(self.table_names, sparse)})

    def push_start(self, grads: Gradients, task_id: int, seq: int) -> list:
        """Send the push keyed by (task, seq); returns a handle for `push_finish`."""
        return self.ps.push_start(task_id, seq, grads.dense, grads.rows, want_dense=True)

    def push_finish(self, handle: list, grads: Gradients) -> bool:
        """Take the fresh parameters back. True if any shard applied the push.

        Several pushes may be in flight and replies can come back in any order, so a shard's
        values are loaded only when newer (by the shard's version) than what the model has."""
        applied, replies = self.ps.push_finish(handle)
        if any(v > self._versions[s] for s, (v, _) in enumerate(replies)):
            self._versions = [max(v, old) for (v, _), old in zip(replies, self._versions)]
            self.set_dense([flat for _, flat in replies])
        if self.table_names and self._ids_of is None:
            self._set_rows({n: (ids, self.ps.pull_rows({n: ids})[n]) for n, (ids, _v) in grads.rows.items()})
        return applied


@dataclasses.dataclass
class Gradients:
    loss: float
    dense: list[np.ndarray]                            # per PS shard: flat gradient buffer
    rows: dict[str, tuple[np.ndarray, np.ndarray]]  # table -> (unique ids, summed row gradients)
