"""A parameter-server shard: holds its share of the parameters and applies the user's optimizer.

Pushes are keyed by `(task_id, seq)` (seq = first record of the minibatch). A key is applied at
most once per shard, so a minibatch pushed by a worker that died before reporting it, and pushed
again by the worker that took over its remainder, changes the parameters only once.
"""
from __future__ import annotations

import io
import logging
import threading

import numpy as np

from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import elastic_pb2_grpc as pb_grpc
from elastic_step.proto import tensors
from elastic_step.proto.rpc import check_token
from elastic_step.ps.api import Placement, variable_names
from elastic_step.util.atomic import atomic_write_bytes

log = logging.getLogger("elastic_step.ps")


class ParameterShard:
    """The parameters one shard owns and the optimizer that updates them (TensorFlow inside)."""

    def __init__(self, model, optimizer, placement: Placement, shard: int):
        import tensorflow as tf

        self.tf = tf
        self.shard = shard
        self.num_ps = placement.num_ps
        self.dense: dict[str, tf.Variable] = {}
        self.tables: dict[str, tf.Variable] = {}
        values = dict(zip(variable_names(model), model.trainable_variables))
        for name in placement.dense_on(shard):
            self.dense[name] = tf.Variable(values[name].numpy(), name=f"d{len(self.dense)}")
        for name, (rows, _dim) in placement.embeddings.items():
            full = values[name].numpy()
            self.tables[name] = tf.Variable(full[shard::self.num_ps], name=f"e{len(self.tables)}")
        self.optimizer = optimizer
        self.optimizer.build(list(self.dense.values()) + list(self.tables.values()))
        self.version = 0
        self.applied: set[tuple[int, int]] = set()
        self.skipped = 0
        self.touched: dict[str, set[int]] = {n: set() for n in self.tables}
        self.lock = threading.Lock()
        dense_vars, tables = list(self.dense.values()), list(self.tables.values())

        # One fixed structure (every dense gradient, every table's rows, possibly none), so the
        # update is traced once and each push is a single compiled call.
        @tf.function(reduce_retracing=True)
        def _apply(dense_grads, table_ids, table_values):
            pairs = list(zip(dense_grads, dense_vars))
            for ids, values, table in zip(table_ids, table_values, tables):
                pairs.append((tf.IndexedSlices(values, ids // self.num_ps,
                                               tf.shape(table, out_type=tf.int64)), table))
            self.optimizer.apply_gradients(pairs)

        self._apply = _apply

    def push(self, key: tuple[int, int], dense_grads: dict[str, np.ndarray],
             emb_grads: list[tuple[str, np.ndarray, np.ndarray]]) -> bool:
        with self.lock:
            if key in self.applied:
                self.skipped += 1
                return False
            rows = {name: (ids, values) for name, ids, values in emb_grads}
            dense = [dense_grads[n] if n in dense_grads else np.zeros(v.shape, v.dtype.as_numpy_dtype)
                     for n, v in self.dense.items()]
            ids_list, values_list = [], []
            for name, table in self.tables.items():
                ids, values = rows.get(name, (np.zeros([0], np.int64),
                                              np.zeros([0, table.shape[1]], table.dtype.as_numpy_dtype)))
                ids_list.append(ids)
                values_list.append(values)
                self.touched[name].update(ids.tolist())
            if dense or ids_list:
                self._apply(dense, ids_list, values_list)
            self.applied.add(key)
            self.version += 1
            return True

    def dense_values(self) -> dict[str, np.ndarray]:
        return {n: v.numpy() for n, v in self.dense.items()}

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        return self.tf.gather(self.tables[name], ids // self.num_ps).numpy()

    def save(self, uri: str) -> None:
        buf = io.BytesIO()
        with self.lock:
            arrays = {f"dense/{n}": v.numpy() for n, v in self.dense.items()}
            arrays.update({f"table/{n}": v.numpy() for n, v in self.tables.items()})
            np.savez(buf, **arrays)
        atomic_write_bytes(uri, buf.getvalue())


class ParameterServerService(pb_grpc.ParameterServerServicer):
    def __init__(self, shard: ParameterShard, token: str):
        self.shard = shard
        self.token = token

    def _dense_reply(self, msg) -> None:
        for n, v in self.shard.dense_values().items():
            nt = msg.dense.add(name=n)
            tensors.encode(v, nt.tensor)

    def PullDense(self, request, context):
        check_token(context, self.token, request.token)
        reply = pb.PullDenseResponse(version=self.shard.version)
        if self.shard.version > request.min_version or request.min_version <= 0:
            self._dense_reply(reply)
        return reply

    def PullEmbedding(self, request, context):
        check_token(context, self.token, request.token)
        reply = pb.PullEmbeddingResponse()
        for lookup in request.lookups:
            ids = tensors.decode(lookup.ids)
            r = reply.rows.add(name=lookup.name)
            r.ids.CopyFrom(lookup.ids)
            tensors.encode(self.shard.rows(lookup.name, ids), r.values)
        return reply

    def PushGradients(self, request, context):
        check_token(context, self.token, request.token)
        dense = {nt.name: tensors.decode(nt.tensor) for nt in request.dense_grads}
        emb = [(e.name, tensors.decode(e.ids), tensors.decode(e.values)) for e in request.embedding_grads]
        applied = self.shard.push((request.task_id, request.seq), dense, emb)
        reply = pb.PushResponse(applied=applied, version=self.shard.version)
        if request.want_dense:
            self._dense_reply(reply)
        return reply

    def Save(self, request, context):
        check_token(context, self.token, request.token)
        self.shard.save(request.uri)
        return pb.Ack()

    def Stats(self, request, context):
        check_token(context, self.token, request.token)
        s = self.shard
        reply = pb.PsStats(shard=s.shard, pushes_applied=len(s.applied), pushes_skipped=s.skipped,
                           dense_names=sorted(s.dense))
        for name, ids in s.touched.items():
            t = reply.touched.add(name=name)
            tensors.encode(np.array(sorted(ids), dtype=np.int64), t.ids)
        return reply
