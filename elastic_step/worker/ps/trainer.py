"""Asynchronous SGD against parameter servers: pull, compute gradients with a GradientTape
in a compiled function, push keyed by (task, minibatch), take the fresh dense values back.

Embedding tables stay whole in the worker's model but only the rows a minibatch looks up are
pulled before the step, and only those rows' gradients are pushed, to their owning shards.

Only the compiled step runs on the training thread. A push (gradients to numpy, encode, the RPC,
decode) runs on a push thread while the next step computes. The step takes each shard's flat dense
values as inputs (Keras's stateless_call) instead of reading the model's variables, so taking fresh
values is swapping a reference: no variable is assigned, and no assignment competes with the step
for TensorFlow's threads.

Several minibatches a call (a model without embedding tables, one minibatch per push): a step, its
push and the shard's update one after another are three calls into TensorFlow a minibatch, where
Keras's fit with steps_per_execution makes one call of many steps, its optimizer included. So the
worker keeps a copy of each shard, its values and its optimizer's state (pulled from it), and runs
several minibatches in one call, applying the shard's own update (ps/server.py, the same code) to
its copy after each, as fit would; each minibatch's gradient is pushed under its own key, and the
shard applies them in turn, in one call. The shard's version tells whether only this worker pushed
meanwhile: then the shard holds exactly what the copy holds (a lone worker trains as fit does, its
updates as many), the next call goes ahead while the push travels, and the fresh values the push
brings back are not needed. On one host such a push carries the copy's state after the call instead
of its gradients (a call's gradients are its minibatches times the model), and the shard takes it;
only a shard that declines it (another worker pushed in between) gets the gradients, read out of
TensorFlow then. When others pushed, the copy takes the shard's values after the newest push of this
worker (the copy's optimizer state follows this worker's own steps until the next pull; the shards
apply every gradient with their own). The number of minibatches a call is sized from the measured
step time (CALL_S), so a user tunes nothing.

Several minibatches a call only while the worker trains alone (Company): with others pushing, a call of
CALL_S is local SGD, hundreds of a small model's steps before the worker takes the others', and it trains to a
worse model than async SGD does (docs/benchmarks.md, the throughput section). So once the shards' versions show
another worker's pushes, the worker trains as a worker without copies does (one minibatch a call on the shards'
newest values, which each push brings back, with as many pushes in flight as pushes_in_flight says), until it
has seen itself alone again for ALONE_AGAIN minibatches in a row; then, its pushes all back, the copies take
the shards' values and optimizer state once more.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import NamedTuple

import numpy as np

from elastic_step.data.accounting import skipped_key
from elastic_step.ps.api import Placement, PushKey, embedding_variable_paths, variable_names
from elastic_step.ps.client import PSClient, ShardsMoved
from elastic_step.ps.doorbell import MAX_MINIBATCHES
from elastic_step.util.phases import phase
from elastic_step.worker.finite import NonFinite
from elastic_step.worker.loss_scale import overflowed
from elastic_step.worker.ps.step import PSSteps, build_steps
from elastic_step.worker.records import Records

log = logging.getLogger("elastic_step.worker")

# Several minibatches a call: about this long a call (from the measured time of a minibatch), at most half a lease.
# Long enough that a call's fixed costs (the call, the push, the shard's taking of the state, a report) weigh
# little, and that a lease of a small model's minibatches goes in 2 calls, not 3 when the step runs a little slow
# (the choice against shorter calls: docs/benchmarks.md, the throughput section). Short enough that a
# checkpoint's hold waits little for a call.
CALL_S = 0.2
# At most this many bytes of gradients a push (its shared slot holds them): a large model runs fewer a call.
MAX_CALL_BYTES = 16 << 20
# After another worker's push, one minibatch a call until this many of this worker's own in a row found no
# other's push on the shards (a few leases: another worker that only paused, waiting for work, is seen back).
ALONE_AGAIN = 256


class Company:
    """Whether this worker trains alone, told by the shards' versions: a shard's version counts the pushes it
    applied, so when it is, after a push of this worker, its version before plus what that push applied, no
    other worker pushed in between. A worker starts alone (its first calls are one minibatch anyway, until one
    is timed); another's push makes it not alone at once; ALONE_AGAIN of its own minibatches in a row with no
    other's make it alone again. Each switch is logged once, with why."""

    def __init__(self, again: int = ALONE_AGAIN):
        self.alone = True
        self._again = again
        self._streak = 0  # own minibatches in a row with no other's push seen

    def seen(self, before: list[int], after: list[int], own: list[int], minibatches: int = 0) -> None:
        """Each shard's version `before` (-1: not known) and `after` this worker's `own` pushes to it were
        applied (a push of `minibatches`; 0 for a pull, which applies none)."""
        others = [(s, a - b - o) for s, (b, a, o) in enumerate(zip(before, after, own)) if b >= 0 and a - b - o >= 0]
        moved = next(((s, n) for s, n in others if n > 0), None)
        if moved is not None:
            self._streak = 0
            if self.alone:
                self.alone = False
                log.info(
                    "another worker pushed (shard %d applied %d push(es) besides this worker's): one minibatch a "
                    "call from now on, async SGD on the shards' newest values",
                    *moved,
                )
            return
        if not others:  # nothing known: a shard restored, or this worker's first push after a pull it missed
            return
        self._streak += minibatches
        if not self.alone and self._streak >= self._again:
            self.alone = True
            log.info(
                "no other worker pushed during this worker's last %d minibatches: training alone, several "
                "minibatches a call again",
                self._streak,
            )


class PSTrainer:
    def __init__(
        self,
        model_def,
        model,
        ps: PSClient,
        placement: Placement,
        pushes_in_flight: int = 2,
        generation: int = 0,
        minibatch_size: int = 64,
        minibatches_per_push: int = 1,
        weight_column: str | None = None,
        non_finite: NonFinite | None = None,
    ):
        """`non_finite`: what to do with a minibatch whose loss or gradient is not finite (default: fail)."""
        import keras
        import tensorflow as tf

        self.tf = tf
        self.model_def = model_def
        self.model = model
        self.non_finite = non_finite or NonFinite()
        self.ps = ps
        self.generation = generation  # of the shards' state (see PushRequest.generation)
        self.placement = placement
        self.weight_column = weight_column  # the data's sample weights (named at prep), or None
        self.names = variable_names(model)
        self.variables = dict(zip(self.names, model.trainable_variables))
        self.table_names = [n for n in self.names if n in placement.embeddings]
        self._ids_of = self._id_extractor(keras, model)
        # Several minibatches a call, on copies of the shards (see the module's docstring): for dense shards.
        self.local = minibatches_per_push == 1 and not self.table_names
        loss_scaling = model_def.loss_scaling(model)
        self.loss_scaled = loss_scaling is not None
        steps = build_steps(
            model_def,
            model,
            placement,
            minibatch_size=minibatch_size,
            minibatches_per_push=minibatches_per_push,
            on_copies=self.local,
            skip_non_finite=self.non_finite.skip,
            state_may_ride=self.local and ps.carries_state(),
            loss_scaling=loss_scaling,
        )
        self._step = steps.step
        self._loss_scale = steps.loss_scale
        self._copies_pushes: set[concurrent.futures.Future] = set()  # pushes of calls on the copies, in flight
        self._step_pushes = 0  # with copies: pushes of one-minibatch steps (not on the copies) not yet finished
        if self.local:
            self._start_copies(steps, pushes_in_flight)
        self._traced = None  # (input specs, concrete step)
        self._flat_specs = steps.flat_specs
        self._bound_spec = tf.TensorSpec([1], tf.int64)
        self._flats = None  # each shard's dense values, as the step's inputs
        self._versions = [-1] * placement.num_ps
        self._fresh_lock = threading.Lock()  # push replies may come back in any order
        self._depth = pushes_in_flight
        self._push_threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=pushes_in_flight, thread_name_prefix="push"
        )

    def _start_copies(self, steps: PSSteps, pushes_in_flight: int) -> None:
        """Several minibatches a call on the copies of the shards that `steps` built: their call, the bookkeeping of
        which shards' versions they match, and the push thread of their calls."""
        copies = steps.copies
        self._state_words = [c.state_words for c in copies] if steps.copies_carry_state else None
        self._copies = copies
        self._local_steps = steps.copies_step
        self._traced_copies = None  # (input specs, concrete local_steps)
        largest = max([c.dense_size for c in copies] + [1])
        self._max_call = max(1, min(MAX_MINIBATCHES, MAX_CALL_BYTES // (4 * largest)))
        self._minibatch_s: float | None = None  # measured, calls that traced left out
        self._lose_track()  # nothing pulled yet: _expect (the shards' versions the copies match), _resync, _base
        self._pending = 0  # pushes of calls on the copies handed over and not yet finished
        self.company = Company()  # several minibatches a call only while alone
        self._pusher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="push")
        # The push of one call in flight while the next computes; pushes_in_flight when not alone.
        self.ps.reserve(max(2, pushes_in_flight), self._max_call, self._state_words)
        log.info(
            "dense shards: this worker applies their updates to copies of its own, up to %d minibatches a call",
            self._max_call,
        )

    @staticmethod
    def _id_extractor(keras, model):
        """A sub-model giving each embedding layer's input ids, so rows are pulled before the step.

        Works for functional models; for subclassed ones rows are refreshed after each push
        instead (one step staler), which async SGD tolerates.
        """
        paths = embedding_variable_paths(model)
        layers = [
            l
            for l in model._flatten_layers(include_self=False)
            if isinstance(l, keras.layers.Embedding) and l.embeddings.path in paths
        ]
        if not layers:
            return None
        try:
            return keras.Model(model.inputs, [l.input for l in layers]), [l.embeddings.path for l in layers]
        except Exception:  # noqa: BLE001 - not a functional graph
            log.info("model is not functional: embedding rows are refreshed after each push")
            return None

    def refresh_dense(self, unless_at: list[int] | None = None) -> None:
        """Pull the shards' current values now. For when this worker's values may be many updates
        old: at its start, after tracing its step (a second or more) and after it waited for work
        (others pushed meanwhile). Gradients from such values, applied late, set the model back.
        With copies of the shards: their values and optimizer state, now, or once this worker's pushes in
        flight are back (the newest brings the shards' values).
        `unless_at`: the shards' versions (a checkpoint's cut): nothing is pulled when the copies are at them,
        as a lone worker's are (no one else pushed since its own last push)."""
        if unless_at and self._on_copies() and not self._pending and not self._resync and unless_at == self._expect:
            return
        if not self._on_copies():
            self._take_fresh(self.ps.pull_dense_at())
            return
        if self._pending:
            self._resync = True
            return
        pulled = self.ps.pull_with_optimizer()
        for copy, (_version, flat, optimizer) in zip(self._copies, pulled):
            copy.load(flat, optimizer)
        versions = [version for version, _flat, _optimizer in pulled]
        self.company.seen(self._expect, versions, [0] * len(versions))
        self._expect = versions
        self._base = list(versions)  # the copies hold each shard's whole state at these versions
        self._resync = False
        if not self.company.alone:  # others pushed: the next steps are on the shards' values, not the copies
            self._take_fresh([(version, flat) for version, flat, _optimizer in pulled])

    def _lose_track(self) -> None:
        """The copies no longer know which of the shards' versions they match: they take the shards' values (and
        optimizer state) before their next call."""
        self._expect = [-1] * self.placement.num_ps
        # Per shard, the version whose whole state (values and optimizer) the copies held before the call whose
        # push goes next, or None: that push then carries no state. Kept by the push thread, which sends the
        # pushes in order and sets it only from a shard's reply; the training thread clears it, and sets it only
        # while no push is in flight (a pull).
        self._base: list[int | None] = [None] * self.placement.num_ps
        self._resync = True

    def _on_copies(self) -> bool:
        """Whether the next call runs on the copies of the shards: while this worker trains alone, once its
        pushes of one-minibatch steps are back (the copies then take every one of them from the shards)."""
        return self.local and self.company.alone and not self._step_pushes

    def set_dense(self, flats: list[np.ndarray]) -> None:
        """Each shard's flat dense values, for the next steps (tensors made here, off the training thread)."""
        self._flats = [self.tf.constant(f, self.tf.float32) for f in flats]

    def _set_rows(self, rows: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        tf = self.tf
        for name, (ids, values) in rows.items():
            # .value is the backing tf.Variable: update just these rows, not the whole table
            self.variables[name].value.scatter_update(tf.IndexedSlices(values, ids))

    def _ids(self, features) -> dict[str, list[np.ndarray]]:
        """Each embedding table's ids looked up by these features (one array per layer using it)."""
        extractor, paths = self._ids_of
        outs = extractor(features, training=False)
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        path_to_name = {v.path: name for name, v in self.variables.items()}
        ids: dict[str, list[np.ndarray]] = {}
        for path, out in zip(paths, outs):
            ids.setdefault(path_to_name[path], []).append(np.asarray(out).astype(np.int64))
        return ids

    def _lease_ids(self, features, n: int) -> dict[str, list[np.ndarray]] | None:
        """The ids of a whole lease's n records, each array with one row per record, so a minibatch's
        are a slice; None when the model has no tables, or when its ids are not one row per record."""
        if not self.table_names or self._ids_of is None:
            return None
        ids = self._ids(features)
        if any(a.ndim == 0 or a.shape[0] != n for arrays in ids.values() for a in arrays):
            return None
        return ids

    def _pull_rows(self, batch: Minibatch) -> None:
        lo, hi = batch.bounds
        if batch.ids is not None:
            ids = {name: [a[lo:hi] for a in arrays] for name, arrays in batch.ids.items()}
        else:  # ids not one row per record: the extractor on this minibatch's own records
            ids = self._ids(self.tf.nest.map_structure(lambda t: t[lo:hi], batch.data[0]))
        lookups = {name: np.unique(np.concatenate([a.ravel() for a in arrays])) for name, arrays in ids.items()}
        pulled = self.ps.pull_rows(lookups)
        self._set_rows({name: (lookups[name], pulled[name]) for name in lookups})

    def feed_lease(self, rows: dict[str, np.ndarray]) -> FedLease:
        """The user's feed() once on a whole lease's records, as Keras's fit feeds a whole array, then
        tensors: each minibatch is a slice of them, taken inside the step. If feed()'s output is not
        row-aligned (a leaf whose first dimension is not the number of records), each minibatch is
        fed on its own instead. Runs off the training thread, ahead of the lease's steps."""
        tf = self.tf
        data = self._data(rows)
        n = len(next(iter(rows.values()))) if rows else 0
        if not all(getattr(leaf, "shape", None) and leaf.shape[0] == n for leaf in tf.nest.flatten(data)):
            return FedLease(rows, None, None, None)
        data = tf.nest.map_structure(tf.convert_to_tensor, data)
        return FedLease(rows, data, self._specs(data), self._lease_ids(data[0], n))

    def minibatch(self, lease: FedLease, lo: int, hi: int, starts: list[int] | None = None) -> Minibatch:
        """Records [lo, hi) of a lease (offsets into it); `starts`: for a call of several minibatches, where
        each begins (the first at lo)."""
        tf = self.tf
        starts = tuple(starts or (lo,))
        if lease.tensors is not None:
            return Minibatch(lease.tensors, (lo, hi), lease.specs, lease.ids, starts)
        data = tf.nest.map_structure(tf.convert_to_tensor, self._data({k: v[lo:hi] for k, v in lease.rows.items()}))
        return Minibatch(data, (0, hi - lo), self._specs(data), None, tuple(b - lo for b in starts))

    def minibatches_per_call(self, left: int, lease: int) -> int:
        """How many of the `left` minibatches of a lease of `lease` go in the next call: about CALL_S of them
        (one until a call that did not trace was timed), at most what a push's slot holds, and at most half the
        lease: the lease before is reported once its last push is back, which the first call overlaps, and the
        lease after is asked for and read meanwhile, which the second call overlaps."""
        if not self._on_copies() or self._minibatch_s is None:
            return 1
        return max(1, min(left, (lease + 1) // 2, self._max_call, int(CALL_S / self._minibatch_s)))

    def pushes_ahead(self, pushes_in_flight: int) -> int:
        """Pushes that may stay in flight while the next call computes: while this worker trains alone, on
        copies of the shards, one, unless the copies are to take the shards' values first (then every push
        comes back before the call); otherwise pushes_in_flight - 1, as without copies."""
        if self.local and self.company.alone:
            return 0 if self._resync or self._step_pushes else 1
        return pushes_in_flight - 1

    def _data(self, rows):
        """(features, labels), or (features, labels, sample weights) when the records are weighted."""
        features, labels, weights = self.model_def.examples(rows, self.weight_column)
        return (features, labels) if weights is None else (features, labels, weights)

    def _specs(self, data):
        """Input specs for any number of records: one traced step serves every lease and minibatch."""
        tf = self.tf
        return tf.nest.map_structure(lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), data)

    def compute(self, batch: Minibatch, where=None) -> StepResult:
        """Gradients of one minibatch at the worker's current parameters (still tensors). `where`: its records,
        as a user finds them, for an error. With copies of the shards: of each minibatch of the call, one after
        another, the copies updated after each (only while this worker trains alone)."""
        if self._on_copies():
            return self._compute_on_copies(batch, where)
        if self.table_names and self._ids_of is not None:
            self._pull_rows(batch)
        try:
            begin, end = (self.tf.constant([b], self.tf.int64) for b in batch.bounds)
            loss, dense, sparse = self._step_for(batch.specs)(batch.data, begin, end, self._flats)
        except ShardsMoved:  # a refresh of the values while tracing met a lost shard: not the user's
            raise
        except Exception as e:  # the user's model/loss failed on real data
            raise self.model_def.user_error(e, "computing a training step", where=str(where or "")) from e
        return StepResult(loss, dense, sparse, where)

    def _compute_on_copies(self, batch: Minibatch, where) -> StepResult:
        tf = self.tf
        traced = self._traced_copies is None or self._traced_copies[0] != batch.specs
        if traced:
            int64s = tf.TensorSpec([None], tf.int64)
            concrete = self._local_steps.get_concrete_function(batch.specs, int64s, int64s)
            self._traced_copies = (batch.specs, concrete)
            self._resync = True  # others pushed while this traced (a second or more)
        if self._resync and not self._pending:
            self.refresh_dense()
        starts = batch.starts or (batch.bounds[0],)
        begins = tf.constant(starts, tf.int64)
        ends = tf.constant((*starts[1:], batch.bounds[1]), tf.int64)
        try:
            if traced:
                self._warm_step(batch)
            started = time.monotonic()
            losses, dense, states, finite = self._traced_copies[1](batch.data, begins, ends)
        except ShardsMoved:
            raise
        except Exception as e:  # the user's model/loss failed on real data
            raise self.model_def.user_error(e, "computing a training step", where=str(where or "")) from e
        if not traced:  # the first run of a trace optimizes its graph: no measure
            took = (time.monotonic() - started) / len(starts)
            self._minibatch_s = took if self._minibatch_s is None else 0.8 * self._minibatch_s + 0.2 * took
        return StepResult(losses, dense, [], where, on_copies=True, states=states, finite=finite)

    def _warm_step(self, batch: Minibatch) -> None:
        """Trace the one-minibatch step too, and run it once (its first run optimizes its graph), result
        unused: once another worker's pushes show, this worker switches to it mid-job, where that first run
        would be taken from training; here it is part of the start."""
        step = self._step_for(batch.specs)
        begin, end = (self.tf.constant([b], self.tf.int64) for b in (batch.bounds[0], batch.bounds[0] + 1))
        scale = self._loss_scale.values() if self._loss_scale is not None else None
        step(batch.data, begin, end, [c.values() for c in self._copies])
        if scale is not None:  # a step that trains nothing moves no loss scale
            self._loss_scale.load(scale)

    def _step_for(self, specs):
        """The step traced once for any minibatch size: a concrete function skips the per-call
        matching of arguments against traces, a noticeable share of a small model's step."""
        if self._traced is None or self._traced[0] != specs:
            self._traced = (
                specs,
                self._step.get_concrete_function(specs, self._bound_spec, self._bound_spec, self._flat_specs),
            )
            self.refresh_dense()  # others pushed while this traced
        return self._traced[1]

    def push_start(
        self, result: StepResult, key: PushKey, bounds: list[int] | None = None
    ) -> concurrent.futures.Future:
        """Push under `key`, for the shards' current generation, on a push thread; `push_finish` waits
        for it. With one push in flight the worker waits for it before its next step anyway: it goes on
        this thread, sparing two thread switches a minibatch. `bounds`: a call of several minibatches,
        theirs (seq, ..., end), each pushed under its own key (with copies of the shards)."""
        key = key._replace(generation=self.generation)
        if result.on_copies:
            self._pending += 1
            handle = self._pusher.submit(self._push_many, result, key, tuple(bounds or (key.seq, key.end)))
            self._copies_pushes.add(handle)
            return handle
        if self.local:
            self._step_pushes += 1
        if self._depth > 1:
            return self._push_threads.submit(self._push, result, key)
        done: concurrent.futures.Future = concurrent.futures.Future()
        try:
            done.set_result(self._push(result, key))
        except Exception as e:  # noqa: BLE001 - raised by push_finish, as from a push thread
            done.set_exception(e)
        return done

    def reconnect(self, ps: PSClient, generation: int) -> PSClient:
        """The shards were restored (after a lost PS): push to them, as `generation`, from their
        values. Returns the old client, to close."""
        old, self.ps, self.generation = self.ps, ps, generation
        with self._fresh_lock:
            self._versions = [-1] * self.placement.num_ps
        if self.local:
            ps.reserve(max(2, self._depth), self._max_call, self._state_words)
            self._lose_track()  # the restored shards count from their checkpoint
        self.refresh_dense()
        return old

    def push_finish(self, handle: concurrent.futures.Future) -> tuple[bool, float]:
        """(applied by any shard, the minibatch's loss), once the push is done: a push of one minibatch."""
        return self.push_finish_each(handle)[0]

    def push_finish_each(self, handle: concurrent.futures.Future) -> list[tuple[bool, float]]:
        """Per minibatch of the push: (applied by any shard, its loss), once the push is done. On the training
        thread, in the order the pushes started: with copies of the shards, they take the shards' values
        here when others pushed meanwhile (or a minibatch was applied before, or skipped)."""
        if handle not in self._copies_pushes:
            return [self._step_pushed(handle)]
        try:
            each, replies = handle.result()
        except BaseException:
            self._lose_track()
            raise
        finally:
            self._pending -= 1
            self._copies_pushes.discard(handle)
        if replies is None:  # went one by one: what the shards applied is not told
            self._lose_track()
        else:
            count = len(each)
            alone = all(all(a) and v == e + count for (v, _, a), e in zip(replies, self._expect))
            versions = [v for v, _, _ in replies]
            self.company.seen(self._expect, versions, [sum(a) for _, _, a in replies], count)
            self._expect = versions
            self._resync = self._resync or not alone
            if self._resync and not self._pending:  # the newest push's values hold every push of ours
                # Unless every shard is at the version whose whole state the copies hold (only this worker's
                # pushes since they last took it: a refresh asked for while a push was out, as at a lease
                # after a wait), when the copies are the shards already and their next push may carry it.
                if self._base != versions:
                    for copy, (_v, values, _a) in zip(self._copies, replies):
                        copy.load(values)
                    self._base = [None] * len(replies)  # the copies' optimizer state is not the shards'
                self._resync = False
        if not self.company.alone:  # the next steps are on the shards' newest values, not the copies
            self._take_fresh(self.ps.pull_dense_at() if replies is None else [(v, f) for v, f, _a in replies])
        return each

    def _step_pushed(self, handle: concurrent.futures.Future) -> tuple[bool, float]:
        """A one-minibatch step's push, done: (applied, loss). With copies of the shards, what its reply's
        versions tell of other workers (Company); replies may come back out of order, which can only make
        another worker's pushes seem more, never fewer, so a worker is never taken to be alone when it is not."""
        try:
            applied, loss, versions = handle.result()
        finally:
            if self.local:
                self._step_pushes -= 1
        if self.local:
            alone = self.company.alone
            self.company.seen(self._expect, versions, [int(applied)] * len(versions), 1)
            self._expect = [max(e, v) for e, v in zip(self._expect, versions)]
            if self.company.alone and not alone:
                self._resync = True  # the copies take the shards' values and optimizer state before their call
        return applied, loss

    def _push_many(self, result: StepResult, key: PushKey, bounds: tuple[int, ...]):
        """A call's minibatches, each under its own key, in one push: (per minibatch (applied, loss), each
        shard's (version, values, applied each)); the replies are None when the minibatches went one by one
        (one was skipped as not finite)."""
        losses, finite = result.loss.numpy(), result.finite.numpy()
        count = len(bounds) - 1

        def at(i):
            w = result.where
            return w._replace(start=bounds[i], end=bounds[i + 1]) if isinstance(w, Records) else w

        # Nothing non-finite is applied (raises unless skipping); the call told which are, the check says why.
        dense = result.dense  # tensors: read only where they are sent (a lone worker's shard takes the state)
        if not finite.all():
            with phase("push thread: gradients to numpy"):
                dense = [g.numpy() for g in result.dense]
        marked = {}  # minibatch -> the key it is pushed under, when not its own: skipped, or by loss scaling
        for i in range(count):
            if finite[i]:
                continue
            k = key._replace(seq=bounds[i], end=bounds[i + 1])
            if self.loss_scaled and overflowed(float(losses[i]), [g[i] for g in dense]):
                marked[i] = k._replace(scale_skipped=True)
            elif self.non_finite.check(float(losses[i]), [g[i] for g in dense], at(i)):
                marked[i] = k._replace(data_shard=skipped_key(k.epoch, k.data_shard)[1])
        if marked:  # one by one, the marked ones under their keys (see _push): the copies are re-pulled
            self._base = [None] * len(dense)
            each = []
            for i in range(count):
                k, grads, loss = key._replace(seq=bounds[i], end=bounds[i + 1]), [g[i] for g in dense], float(losses[i])
                if i in marked:
                    k, grads = marked[i], [np.zeros_like(g) for g in grads]
                    loss = loss if k.scale_skipped else float("nan")
                applied, _ = self.ps.push(k, grads, {}, want_dense=False)
                each.append((applied, loss))
            return each, None
        bases, states = self._base, None
        if result.states and any(b is not None for b in bases):
            with phase("push thread: the copies' state to numpy"):
                states = [None if b is None else (w.numpy(), b) for w, b in zip(result.states, bases)]
        self._base = [None] * len(dense)  # until the replies show each shard took the whole call
        with phase("push thread: push, the PS's updates, fresh values back"):
            applied, replies = self.ps.push_many(key, bounds, dense, states)
        # A shard that applied every minibatch of the call right after the version the call started from holds
        # what the copy holds, whether it took the state or ran the updates: the next call's push may carry it.
        self._base = [
            v if b is not None and all(a) and v == b + count else None for b, (v, _values, a) in zip(bases, replies)
        ]
        return [(a, float(loss)) for a, loss in zip(applied, losses)], replies

    def _push(self, result: StepResult, key: PushKey) -> tuple[bool, float, list[int]]:
        """(applied, loss, each shard's version after it)."""
        with phase("push thread: gradients to numpy"):
            dense = [g.numpy() for g in result.dense]
            rows = {n: (ids.numpy(), v.numpy()) for n, (ids, v) in zip(self.table_names, result.sparse)}
            loss = float(result.loss)
        # Checked here, on the push thread, where the values are numpy anyway: nothing non-finite is applied.
        if self.loss_scaled and overflowed(loss, [*dense, *(v for _ids, v in rows.values())]):
            # Loss scaling skipped it (worker/loss_scale.py): every shard accounts for its records as trained
            # and applies nothing, as Keras's LossScaleOptimizer skips the step.
            key = key._replace(scale_skipped=True)
            dense, rows = [np.zeros_like(g) for g in dense], {}
        elif self.non_finite.check(loss, [*dense, *(v for _ids, v in rows.values())], result.where):
            # Skipped: every shard gets the key of a skipped minibatch (its data shard's complement), applies
            # nothing and accounts for its records as skipped (ps/server.py), so no shard applies part of it.
            key = key._replace(data_shard=skipped_key(key.epoch, key.data_shard)[1])
            dense, rows, loss = [np.zeros_like(g) for g in dense], {}, float("nan")
        with phase("push thread: push, the PS's update, fresh values back"):
            applied, replies = self.ps.push(key, dense, rows, want_dense=True)
        with phase("push thread: fresh values to tensors"):
            self._take_fresh(replies)
        if self.table_names and self._ids_of is None:
            self._set_rows({n: (ids, self.ps.pull_rows({n: ids})[n]) for n, (ids, _v) in rows.items()})
        return applied, loss, [version for version, _ in replies]

    def _take_fresh(self, replies: list[tuple[int, np.ndarray]]) -> None:
        """Load each shard's values only when newer (by the shard's version) than what the model has:
        with several pushes in flight, replies come back in any order."""
        with self._fresh_lock:
            if any(v > self._versions[s] for s, (v, _) in enumerate(replies)):
                self._versions = [max(v, old) for (v, _), old in zip(replies, self._versions)]
                self.set_dense([flat for _, flat in replies])

    def close(self) -> None:
        self._push_threads.shutdown(wait=True)
        if self.local:
            self._pusher.shutdown(wait=True)


class StepResult(NamedTuple):
    """One step's output, as tensors: converting them to numpy is the push thread's job."""

    loss: object  # scalar tensor (a call of several minibatches, on copies of the shards: one for each)
    dense: list  # per PS shard: flat gradient buffer ([minibatches, its floats] for a call of several)
    sparse: list  # per embedding table: (unique ids, summed row gradients)
    where: object = None  # its records (finite.Records), as a user finds them
    on_copies: bool = False  # a call on copies of the shards (its push: each minibatch under its own key)
    states: list = []  # with copies on one host: each copy's state after the call (ParameterShard.words)
    finite: object = None  # on copies: whether each minibatch's loss and gradients are finite


class FedLease(NamedTuple):
    rows: dict  # column -> the lease's values, as read
    tensors: tuple | None  # feed(rows) as tensors (features, labels[, sample weights]), or None when not row-aligned
    specs: object  # their TensorSpecs, any number of rows: picks the traced step
    ids: dict | None  # table -> its ids per record, when the model has tables


class Minibatch(NamedTuple):
    data: (
        tuple  # (features, labels[, sample weights]): tensors holding the minibatch's records (its lease's, or its own)
    )
    bounds: tuple[int, int]  # the minibatch's records in them, [lo, hi)
    specs: object
    ids: dict | None
    starts: tuple = ()  # a call of several minibatches: where each begins in them (the first at lo)
