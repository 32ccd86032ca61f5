"""A parameter-server shard: holds its share of the parameters and applies the user's optimizer.

Pushes are keyed by `(task_id, seq)` (seq = first record of the minibatch). A key is applied at
most once per shard, so a minibatch pushed by a worker that died before reporting it, and pushed
again by the worker that took over its remainder, changes the parameters only once.
"""

from __future__ import annotations

import io
import json
import logging
import threading

import grpc
import numpy as np

from elastic_step.data.accounting import AppliedRecords
from elastic_step.optimizers import without_clipping
from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import elastic_pb2_grpc as pb_grpc
from elastic_step.proto import tensors
from elastic_step.proto.rpc import check_token
from elastic_step.ps.api import (
    CHANGED_MODEL,
    FINAL_DENSE,
    FINAL_TABLE,
    Placement,
    PushKey,
    layout_mismatch,
)
from elastic_step.ps.doorbell import DoorbellServer, Dropped, FencedPush, Refused
from elastic_step.ps.push_slots import SharedSegments
from elastic_step.ps.shard_graph import build_graph, compile_graph, shard_variables
from elastic_step.util.phases import phase

log = logging.getLogger("elastic_step.ps")


class ParameterShard:
    """The parameters one shard owns, the optimizer that updates them, and its share of the model's
    state (TensorFlow inside)."""

    def __init__(self, model, optimizer, placement: Placement, shard: int, serve: bool = True):
        """`serve` False: a worker's copy of the shard (worker/ps/step.py), updated inside the worker's own compiled
        call through `update` and `values`: nothing of its own is traced."""
        import tensorflow as tf

        self.tf = tf
        self.shard = shard
        self.num_ps = placement.num_ps
        # A norm to clip by spans every shard's gradients: the worker clips each push as the optimizer
        # would, before splitting it over the shards.
        variables = shard_variables(model, without_clipping(optimizer), placement, shard)
        self.dense_names = variables.dense_names
        self.tables: dict[str, tf.Variable] = variables.tables
        self.dense_vars = variables.dense_vars
        self.state = variables.state
        self.optimizer = variables.optimizer
        self.layout = variables.layout
        self.dense_size = variables.dense_size
        self.version = 0
        self.applied: set[tuple[int, int]] = set()
        self.applied_records = AppliedRecords()
        self.generation = 0  # bumped by each restore: pushes of another generation are refused
        self.fences = PushFences(shard)  # worker launches the master gave up: their pushes are refused
        self.skipped = 0
        self.touched: dict[str, set[int]] = {n: set() for n in self.tables}
        self.lock = threading.Lock()
        self._taken: tuple[int, dict] | None = None  # (checkpoint, state arrays): taken, not yet sent
        graph = build_graph(variables, self.num_ps)
        self.state_words = graph.state_words
        self.states_taken = 0
        # The newest state taken (push_many), not yet in the variables: loaded once they are read or updated
        # (_settle). A lone worker's every push then costs the shard a copy, not a call into TensorFlow.
        self._kept: np.ndarray | None = None
        self._kept_new = False
        self.update, self.values, self.words = graph.update, graph.values, graph.words
        self._apply_many = self._final = None
        if not serve:
            return
        compiled = compile_graph(variables, graph)
        self._apply, self._apply_many, self._read = compiled.apply, compiled.apply_many, compiled.read
        self._load_words, self._final = compiled.load_words, compiled.final

    def push(
        self,
        key: PushKey,
        flat_grad: np.ndarray,
        emb_grads: list[tuple[str, np.ndarray, np.ndarray]],
        out: np.ndarray | None = None,
    ) -> tuple[bool, int, np.ndarray]:
        """Apply a keyed push at most once, and account for its records. Returns (applied, version,
        the shard's flat dense values at that version), the values written into `out` when given (a
        shared push slot)."""
        self.fences.check(key)
        with self.lock:
            if key.generation != self.generation:
                raise StaleGeneration(
                    f"a push of generation {key.generation} to shard {self.shard}, which is "
                    f"at generation {self.generation}: it was restored to a checkpoint since"
                )
            if key.idempotency in self.applied:
                self.skipped += 1
                return False, self.version, self._values(out)
            if flat_grad.size != self.dense_size:
                raise ValueError(
                    f"push carries {flat_grad.size} dense gradients, shard {self.shard} "
                    f"holds {self.dense_size} parameters"
                )
            if key.data_shard < 0:
                # A minibatch a worker skipped (--skip-non-finite), its data shard named by its complement
                # (data/accounting.py, skipped_key): nothing to apply, its records accounted for as skipped, once.
                self.applied.add(key.idempotency)
                self.applied_records.add(key.epoch, key.data_shard, key.seq, key.end)
                return True, self.version, self._values(out)
            if key.scale_skipped:
                # A step loss scaling skipped (its gradient overflowed at the worker's scale): nothing to apply,
                # its records trained, as Keras's LossScaleOptimizer skips a step that consumed its batch. It is a
                # step all the same: the version counts it, as a worker counting its own pushes expects.
                self.applied.add(key.idempotency)
                self.applied_records.add(key.epoch, key.data_shard, key.seq, key.end)
                self.version += 1
                return True, self.version, self._values(out)
            if not np.isfinite(flat_grad).all() or not all(np.isfinite(v).all() for _n, _i, v in emb_grads):
                raise ValueError(f"a push to shard {self.shard} holds a gradient that is not finite: not applied")
            rows = {name: (ids, values) for name, ids, values in emb_grads}
            ids_list, values_list = [], []
            for name, table in self.tables.items():
                ids, values = rows.get(
                    name, (np.zeros([0], np.int64), np.zeros([0, table.shape[1]], table.dtype.as_numpy_dtype))
                )
                ids_list.append(ids)
                values_list.append(values)
                if len(ids):
                    self.touched[name].update(ids.tolist())
            tf = self.tf
            self._settle()
            fresh = self._apply(
                tf.constant(flat_grad, tf.float32),
                [tf.constant(i, tf.int64) for i in ids_list],
                [tf.constant(v, t.dtype) for v, t in zip(values_list, self.tables.values())],
            )
            values = self._copy(fresh, out)
            self.applied.add(key.idempotency)
            self.applied_records.add(key.epoch, key.data_shard, key.seq, key.end)
            self.version += 1
            return True, self.version, values

    def push_many(
        self,
        key: PushKey,
        bounds: tuple[int, ...],
        flat_grads: np.ndarray,
        out: np.ndarray | None = None,
        state: np.ndarray | None = None,
        state_base: int | None = None,
    ) -> tuple[list[bool], int, np.ndarray]:
        """Apply the pushes of several minibatches of one lease, computed one after another: minibatch i is
        [bounds[i], bounds[i + 1]), keyed (key.task_id, bounds[i]), its flat gradient flat_grads[i]. Each not
        applied before is applied, in turn, in one call; the others are skipped, as single pushes are. Returns
        (whether each was applied, version, the values at that version), as `push` does.

        `state`: a lone worker's copy of this shard after those updates (`words`), computed from this shard's
        state at version `state_base`, sent instead of the gradients (`flat_grads` is then not read). While the
        shard is still at that version and applies every minibatch, the updates would leave it exactly that
        state, so it takes it rather than run them again (on one host the shard's update competes with the
        worker's step for the cores). Otherwise it applies nothing and counts nothing: every minibatch comes
        back not applied, and the worker sends the gradients."""
        self.fences.check(key)
        count = len(bounds) - 1
        with self.lock:
            if key.generation != self.generation:
                raise StaleGeneration(
                    f"a push of generation {key.generation} to shard {self.shard}, which is "
                    f"at generation {self.generation}: it was restored to a checkpoint since"
                )
            if self._apply_many is None or key.data_shard < 0 or key.scale_skipped:
                raise ValueError(f"shard {self.shard} takes pushes of several minibatches only of dense gradients")
            if count < 1 or flat_grads.shape[0] < count or flat_grads.shape[-1] != self.dense_size:
                raise ValueError(
                    f"a push of {count} minibatches carries {flat_grads.shape} dense gradients, shard "
                    f"{self.shard} holds {self.dense_size} parameters"
                )
            each = [(key.task_id, b) not in self.applied for b in bounds[:-1]]
            todo = np.nonzero(each)[0]
            if state_base is not None:  # a state, not gradients
                if state is None or not (
                    state_base == self.version and len(todo) == count and 0 < self.state_words <= state.size
                ):
                    return [False] * count, self.version, self._values(out)  # declined: the gradients follow
                words = state[: self.state_words]
                values = words[: self.dense_size]
                if not np.isfinite(values).all():
                    raise ValueError(f"a push to shard {self.shard} holds values that are not finite: not applied")
                if self._kept is None:
                    self._kept = np.empty(self.state_words, np.float32)
                np.copyto(self._kept, words)  # the slot is the worker's again once this returns
                self._kept_new = True
                self.states_taken += 1
                # The shard's values are now the state's, bit for bit: in a shared slot they are already in `out`.
                values = values if out is not None and np.shares_memory(out, values) else self._copy_array(values, out)
            else:
                self.skipped += count - len(todo)
                if not len(todo):
                    return each, self.version, self._values(out)
                grads = flat_grads[todo] if len(todo) < count else flat_grads[:count]
                if not np.isfinite(grads).all():
                    raise ValueError(f"a push to shard {self.shard} holds a gradient that is not finite: not applied")
                self._settle()
                values = self._copy(self._apply_many(self.tf.constant(grads, self.tf.float32)), out)
            for i in todo:
                self.applied.add((key.task_id, bounds[i]))
                self.applied_records.add(key.epoch, key.data_shard, bounds[i], bounds[i + 1])
            self.version += len(todo)
            return each, self.version, values

    def _settle(self) -> None:
        """The state taken last (push_many) into the variables, when they do not hold it yet; before anything
        reads or updates them (lock held)."""
        if self._kept_new:
            self._kept_new = False
            self._load_words(self.tf.constant(self._kept))

    def load(self, flat: np.ndarray, optimizer: list[np.ndarray] | None = None) -> None:
        """The shard's values (flat, as `values` gives them) and, when given, its optimizer's variables: a
        worker's copy taking the shard's."""
        self._settle()  # the optimizer's variables not given stay as they are
        offset = 0
        for v in [*self.dense_vars, self.state]:
            n = int(v.shape.num_elements())
            v.assign(np.asarray(flat[offset : offset + n]).reshape(v.shape))
            offset += n
        for var, value in zip(self.optimizer.variables, optimizer or []):
            var.assign(np.asarray(value).reshape(tuple(var.shape)))

    def optimizer_values(self) -> tuple[int, np.ndarray, list[np.ndarray]]:
        """(version, the flat values, the optimizer's variables), at one moment."""
        with self.lock:
            self._settle()
            return self.version, self._values(), [np.asarray(v.numpy()) for v in self.optimizer.variables]

    def _values(self, out: np.ndarray | None = None) -> np.ndarray:
        self._settle()
        return self._copy(self._read(), out)

    @classmethod
    def _copy(cls, values, out: np.ndarray | None) -> np.ndarray:
        """A private copy of flat values (into `out` when given), taken under the lock: a read may
        alias the variable's buffer, which the next update rewrites in place, and replies are
        encoded after the lock is released."""
        return cls._copy_array(values.numpy(), out)

    @staticmethod
    def _copy_array(current: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        if out is None:
            return current.copy()
        np.copyto(out, current)
        return out

    def dense_flat(self) -> np.ndarray:
        return self.snapshot()[1]

    def snapshot(self) -> tuple[int, np.ndarray]:
        """(version, the flat dense values at that version)."""
        with self.lock:
            return self.version, self._values()

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        return self.tf.gather(self.tables[name], ids // self.num_ps).numpy()

    def save(self) -> bytes:
        """The shard's whole state at one moment, as an .npz: its values, its optimizer's variables
        (slots, step count), and the keys and records of the pushes it applied, so that a shard
        restored from it skips what it had applied and the audit sees exactly what it holds. With
        use_ema, also the values a model finished now would hold (FINAL_DENSE, FINAL_TABLE + name):
        the moving averages, laid out as the values are."""
        with self.lock:
            arrays = self._state_arrays()
        return _npz(arrays)

    def take(self, cut: int) -> int:
        """`save`'s state at this moment, kept in memory as checkpoint `cut`'s until `send` (the workers
        are held only while the copies are made, not while they are serialized and sent). Its version."""
        with self.lock:
            arrays = self._state_arrays()
        self._taken = (cut, arrays)
        return int(arrays["version"])

    def send(self, cut: int) -> bytes:
        """The state `take` kept for checkpoint `cut`, as `save` gives it; forgotten once sent."""
        taken, self._taken = self._taken, None
        if taken is None or taken[0] != cut:
            raise KeyError(f"no state taken for checkpoint {cut} (taken: {None if taken is None else taken[0]})")
        return _npz(taken[1])

    def _state_arrays(self) -> dict:
        """Copies of everything `save` writes (lock held), private ones (a variable's read may alias the buffer the
        next update rewrites in place, and `take` keeps them past the lock); what is slow to order or serialize is
        left to `_npz`."""
        self._settle()
        arrays = {
            "dense": np.array(self._values()),
            "version": np.array(self.version, np.int64),
            "skipped": np.array(self.skipped, np.int64),
            "applied_keys": list(self.applied),
            "layout": json.dumps([(shape, str(dtype)) for _n, shape, dtype in self.layout]),
        }
        arrays.update({f"table/{n}": np.array(v.numpy()) for n, v in self.tables.items()})
        arrays.update({f"optimizer/{i}": np.array(v.numpy()) for i, v in enumerate(self.optimizer.variables)})
        arrays.update(self.applied_records.npz())
        arrays.update({f"touched/{n}": sorted(ids) for n, ids in self.touched.items()})
        if self._final is not None:
            flat, tables = self._final()
            arrays[FINAL_DENSE] = np.array(flat.numpy())
            arrays.update({FINAL_TABLE + n: np.array(t.numpy()) for n, t in zip(self.tables, tables)})
        return arrays

    def restore(self, npz: bytes, generation: int = 0) -> None:
        """Back to the state `save` wrote (the shard's values, its optimizer's, what it applied), as
        generation `generation`: from here on, only pushes computed for it are applied."""
        saved = dict(np.load(io.BytesIO(npz), allow_pickle=False))
        optimizer = [saved[f"optimizer/{i}"] for i in range(len(self.optimizer.variables)) if f"optimizer/{i}" in saved]
        there = f"the checkpoint's shard {self.shard}"
        if "layout" in saved:  # every variable's shape and dtype
            mismatch = layout_mismatch(self.layout, [(tuple(s), d) for s, d in json.loads(str(saved["layout"]))], there)
        elif (  # a checkpoint written before layouts were saved: sizes and numbers only
            saved["dense"].size != self.dense_size
            or any(f"table/{n}" not in saved for n in self.tables)
            or len(optimizer) != len(self.optimizer.variables)
            or f"optimizer/{len(optimizer)}" in saved
        ):
            mismatch = f"{there} holds another model's values"
        else:
            mismatch = None
        if mismatch is not None:
            raise ValueError(f"{mismatch}: {CHANGED_MODEL}")
        with self.lock:
            self.generation = generation
            self.load(saved["dense"], optimizer)
            for name, table in self.tables.items():
                table.assign(saved[f"table/{name}"])
            self.version = int(saved["version"])
            self.skipped = int(saved["skipped"])
            self.applied = {(int(t), int(q)) for t, q in saved["applied_keys"]}
            self.applied_records = AppliedRecords.of_npz(saved)
            self.touched = {n: set(saved.get(f"touched/{n}", np.zeros(0, np.int64)).tolist()) for n in self.tables}


def _npz(arrays: dict) -> bytes:
    """A shard's state arrays (ParameterShard._state_arrays) as the .npz a checkpoint holds."""
    arrays = {
        **arrays,
        "applied_keys": np.array(sorted(arrays["applied_keys"]), np.int64).reshape(-1, 2),
        "layout": np.array(arrays["layout"]),
        **{n: np.array(v, np.int64) for n, v in arrays.items() if n.startswith("touched/")},
    }
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


class PushFences:
    """The worker launches the master fenced (declared lost, their leases requeued): their pushes are refused and
    counted, whatever their key, so a zombie (a frozen worker resumed, a partitioned pod back) applies nothing beside
    its successor. Per worker, every launch up to the highest fenced one: launches only grow. A push that names no
    launch (0) is not fenced."""

    def __init__(self, shard: int):
        self.shard = shard
        self.lock = threading.Lock()
        self.through: dict[int, int] = {}  # worker index -> highest fenced launch
        self.refused = 0

    def fence(self, worker: int, launch: int) -> None:
        with self.lock:
            if launch > self.through.get(worker, 0):
                self.through[worker] = launch
                log.info("worker-%d launch %d fenced: its pushes are refused from now on", worker, launch)

    def check(self, key: PushKey) -> None:
        """Raise FencedPush when `key`'s launch is fenced."""
        if key.launch <= 0 or key.launch > self.through.get(key.worker, 0):
            return
        with self.lock:
            self.refused += 1
            n = self.refused
        log.warning(
            "refused a push of worker-%d launch %d (task %d, records [%d, %d)): fenced; %d push(es) refused so far",
            key.worker, key.launch, key.task_id, key.seq, key.end, n,
        )  # fmt: skip
        raise FencedPush(
            f"fenced: worker-{key.worker} launch {key.launch} was given up by the master; shard {self.shard} "
            "refuses its pushes"
        )


class StaleGeneration(Exception):
    """A push computed for the shards' state before they were restored: never applied."""


class ParameterServerService(pb_grpc.ParameterServerServicer):
    def __init__(self, shard: ParameterShard, token: str):
        self.shard = shard
        self.token = token
        self.segments = SharedSegments()  # push slots of workers on this host
        self.doorbell: DoorbellServer | None = None  # opened with the first segment attached
        self._doorbell_lock = threading.Lock()

    def PullDense(self, request, context):
        check_token(context, self.token, request.token)
        if request.optimizer:
            version, values, optimizer = self.shard.optimizer_values()
            reply = pb.PullDenseResponse(version=version)
            tensors.encode(values, reply.dense_flat)
            for v in optimizer:
                tensors.encode(v, reply.optimizer.add())
            return reply
        version, values = self.shard.snapshot()
        reply = pb.PullDenseResponse(version=version)
        if version > request.min_version or request.min_version <= 0:
            tensors.encode(values, reply.dense_flat)
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
        emb = [(e.name, tensors.decode(e.ids), tensors.decode(e.values)) for e in request.embedding_grads]
        out = None
        if request.HasField("shared"):
            try:
                # The fresh values go straight into the worker's slot, beside its gradient.
                grads, out, state = self.segments.slot(request.shared.segment, request.shared.slot)
            except KeyError as e:  # dropped (least recently used) or never attached: nothing applied
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"unknown shared push slot {e}")
        else:
            grads, state = tensors.decode(request.dense_grads_flat).reshape(max(1, len(request.bounds) - 1), -1), None
        base = request.state_base if request.HasField("state_base") else None
        each = []
        try:
            if request.bounds:
                each, version, values = self.shard.push_many(
                    PushKey.of(request), tuple(request.bounds), grads, out, state, base
                )
                applied = any(each)
            else:
                applied, version, values = self.shard.push(PushKey.of(request), grads[0], emb, out)
        except ValueError as e:  # a worker built a different model: refuse, do not corrupt
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except StaleGeneration as e:  # ABORTED, not FAILED_PRECONDITION: that one means a dropped slot
            context.abort(grpc.StatusCode.ABORTED, str(e))
        except FencedPush as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        reply = pb.PushResponse(applied=applied, version=version, applied_each=each)
        if request.want_dense and out is None:
            tensors.encode(values, reply.dense_flat)
        return reply

    def AttachShared(self, request, context):
        check_token(context, self.token, request.token)
        if request.floats != self.shard.dense_size:
            return pb.AttachSharedResponse(
                refused=f"slots of {request.floats} floats, shard {self.shard.shard} "
                f"holds {self.shard.dense_size} parameters"
            )
        if request.state_words not in (0, self.shard.state_words):
            return pb.AttachSharedResponse(
                refused=f"room for a state of {request.state_words} words, shard {self.shard.shard}'s "
                f"is {self.shard.state_words} (another optimizer?)"
            )
        try:
            segment = self.segments.attach(
                request.path,
                request.nonce,
                request.floats,
                request.slots,
                max(1, request.minibatches),
                request.state_words,
            )
        except ValueError as e:
            return pb.AttachSharedResponse(refused=str(e))
        with self._doorbell_lock:
            if self.doorbell is None:
                try:
                    self.doorbell = DoorbellServer(self.segments.admits, self._ring)
                except OSError as e:  # no Unix sockets here: pushes keep using gRPC calls
                    log.info("no doorbell for shared pushes (%s): they use gRPC calls", e)
        return pb.AttachSharedResponse(segment=segment, doorbell=self.doorbell.address if self.doorbell else "")

    def _ring(
        self,
        segment: int,
        slot: int,
        key: PushKey,
        want_dense: bool,
        bounds: tuple[int, ...],
        state_base: int | None = None,
    ) -> tuple[bool, int, list[bool]]:
        """A push rung through the doorbell: its gradients (and a copy's state) are in the slot, its values
        go back there."""
        try:
            grads, out, state = self.segments.slot(segment, slot)
        except KeyError as e:
            raise Dropped(str(e)) from e
        try:
            if bounds:
                with phase("ps: apply a push of several minibatches (rung)"):
                    each, version, _ = self.shard.push_many(key, bounds, grads, out, state, state_base)
                return any(each), version, each
            with phase("ps: apply a push (rung)"):
                applied, version, _ = self.shard.push(key, grads[0], [], out)
        except StaleGeneration as e:
            raise Refused(str(e)) from None
        return applied, version, [applied]

    def close(self) -> None:
        if self.doorbell is not None:
            self.doorbell.close()

    def DetachShared(self, request, context):
        check_token(context, self.token, request.token)
        self.segments.detach(request.segment)
        return pb.Ack()

    def Save(self, request, context):
        check_token(context, self.token, request.token)
        if request.stage == pb.SaveRequest.TAKE:
            return pb.ShardState(version=self.shard.take(request.cut))
        if request.stage == pb.SaveRequest.SEND:
            try:
                return pb.ShardState(npz=self.shard.send(request.cut))
            except KeyError as e:  # a PS relaunched since the take, or a take of another checkpoint
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"shard {self.shard.shard}: {e.args[0]}")
        return pb.ShardState(npz=self.shard.save())

    def Restore(self, request, context):
        check_token(context, self.token, request.token)
        try:
            self.shard.restore(request.npz, request.generation)
        except (OSError, ValueError, KeyError) as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot restore shard {self.shard.shard}: {e}")
        return pb.Ack()

    def Fence(self, request, context):
        check_token(context, self.token, request.token)
        if request.instance.role != "worker" or request.instance.launch <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"only a worker launch is fenced, not {request.instance}")
        self.shard.fences.fence(request.instance.index, request.instance.launch)
        return pb.Ack()

    def Stats(self, request, context):
        check_token(context, self.token, request.token)
        s = self.shard
        reply = pb.PsStats(
            shard=s.shard,
            pushes_applied=len(s.applied),
            pushes_skipped=s.skipped,
            dense_parameters=s.dense_size,
            pushes_fenced=s.fences.refused,
            states_taken=s.states_taken,
        )
        if request.brief:  # a liveness probe: an answer is all it needs, and it must not wait on a push
            return reply
        with s.lock:
            for name, ids in s.touched.items():
                t = reply.touched.add(name=name)
                tensors.encode(np.array(sorted(ids), dtype=np.int64), t.ids)
            tensors.encode_applied(s.applied_records.arrays(), reply.applied)
        return reply
