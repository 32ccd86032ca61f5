"""A worker of `--strategy allreduce`: synchronous SGD, an elastic ring AllReduce, atomic runs of steps.

Per step, each member of the master's membership version v:
  1. takes its minibatch(es) from its own lease (the ledger's lease/watermark, as in PS mode);
  2. computes gradients with a GradientTape in one compiled call (one flat float32 buffer);
  3. ring-allreduces [sum of record-weighted gradients, records, loss*records, every member's
     contribution, whether a member asks the run to end] with its peers;
  4. applies the average with the user's optimizer at once (identical on every member).
The steps since the last commit are a run (`Run`). It ends at a step where any member asked for it in
the buffer (its lease ends, it has no data, or the run has RUN_STEPS steps or lasted RUN_S), so every
member ends it at the same step. Then each calls `StepReady(v, last step, task, watermark, checksum of
its weights)`: the master answers COMMIT once every member of v is ready (then it has committed every
member's watermark at once), or ABORT with a new membership (a member was lost). A run that does not
commit, aborted there or in a collective, is undone: the trainer kept the committed state when the
run's first step was applied, goes back to it, and the same minibatches are trained again in the new
ring (a run's first step keeps its gradients: the weights are those it was computed on). Until COMMIT
a member's peers and the master's checkpoints pull the kept state, never a partial run. A master's
round trip per run instead of per step: for a small model it was a third of a step.
A run's steps after its first run in one compiled call (`AllReduceTrainer.run_steps`): a loop that applies the
last average, computes the next minibatch's gradient and calls back into Python for the rest of the step (the
collective, the run's and lease's bookkeeping), which hands it the next average, or ends the loop at the run's end.
A call's fixed cost was several times a small model's whole step. The run's first step, one that a new rate or a
minibatch that is not finite interrupts, and steps of several minibatches (`fixed` below fewer members) take one
call each.
A newcomer is admitted at a run's commit; it pulls every weight and optimizer variable from rank 0
(once rank 0 has committed that step), then takes part from the next step on. In a job resumed from a
checkpoint, every member of the first version loads the checkpoint's state from the master instead
(MembershipReply.restore_checkpoint), and drops any lease of a previous master's.

Global batch (`--global-batch`):
  * `scaled` (default): each member does one minibatch of `minibatch_size` per step, so the global
    batch is world × minibatch_size and follows the membership; the learning rate is scaled
    linearly with it: lr = base_lr × trained / max_workers, where `trained` counts the members that
    trained a minibatch in the step (a member whose lease ran out contributes none) and base_lr is the
    model definition's optimizer's (or its schedule's), meant for the full-strength job.
  * `fixed`: the global batch stays ≈ max_workers × minibatch_size whatever the membership: each
    member accumulates ceil(max_workers / world) minibatches per step (fewer at the end of its
    lease), weighted by record counts; the learning rate is left alone.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import zlib

import grpc
import numpy as np

from elastic_step.data.api import AppliedRecords, minibatch_end, skipped_key
from elastic_step.errors import ConfigError
from elastic_step.faults import api as faults
from elastic_step.instance.master_client import MasterClient
from elastic_step.optimizers import LearningRateScale, updater
from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import rpc, tensors
from elastic_step.ps.api import CHANGED_MODEL, CHANGED_MODEL_FIX, layout_mismatch
from elastic_step.worker.collective import Aborted, PeerFailed, Ring, StateProvider, pull_state
from elastic_step.worker.finite import NonFinite
from elastic_step.worker.records import Records, working_on

log = logging.getLogger("elastic_step.worker")

MR = pb.MembershipReply


class AllReduceTrainer:
    """The model, the user's optimizer, and compiled calls over one flat gradient buffer."""

    def __init__(self, model_def, model, non_finite: NonFinite | None = None, weight_column: str | None = None):
        """`non_finite`: what to do with a minibatch whose loss or gradient is not finite (default: fail);
        `weight_column`: the data's sample weights (named at prep), or None."""
        import tensorflow as tf

        self.tf = tf
        self.model_def = model_def
        self.model = model
        self.weight_column = weight_column  # the data's sample weights (named at prep), or None
        self.non_finite = non_finite or NonFinite()
        self.optimizer = model_def.optimizer()
        trainable = model.trainable_variables
        self.optimizer.build(trainable)
        self.lr_scale = LearningRateScale(self.optimizer)
        # The records whose updates the weights hold: every member's contribution to each applied step.
        self.applied_records = AppliedRecords()
        self.size = sum(int(v.shape.num_elements()) for v in trainable)
        sizes = [int(v.shape.num_elements()) for v in trainable]
        self._offsets, self._names = np.cumsum(sizes)[:-1], [v.path for v in trainable]

        def loss_and_gradient(data):
            features, labels, *weights = data  # (features, labels[, sample weights])
            with tf.GradientTape() as tape:
                loss = model_def.training_loss(model, features, labels, *weights)
            grads = tape.gradient(loss, trainable)
            flat = tf.concat(
                [
                    tf.reshape(tf.cast(tf.zeros_like(v) if g is None else tf.convert_to_tensor(g), tf.float32), [-1])
                    for g, v in zip(grads, trainable)
                ],
                0,
            )
            return loss, flat

        @tf.function(reduce_retracing=True)
        def grad_step(data):
            return loss_and_gradient(data)

        def sliced(data, begin, end):
            # The minibatch is sliced from its lease's tensors here, in the graph: no feed() per step.
            # (One op per tensor: `begin`/`end` are [lo]/[hi], the other dimensions taken whole.)
            return tf.nest.map_structure(lambda t: tf.strided_slice(t, begin, end), data)

        def flat_weights():
            return tf.concat([tf.reshape(tf.cast(v, tf.float32), [-1]) for v in model.weights], 0)

        update = updater(self.optimizer, trainable)

        def apply_mean(flat):
            update([tf.cast(tf.reshape(p, v.shape), v.dtype) for p, v in zip(tf.split(flat, sizes), trainable)])

        # Steps are applied before the master commits them, a run of steps at a time (AllReduceWorker). What the
        # first was applied to is kept aside, in variables of the same shapes: the committed state, which a peer or
        # a checkpoint pulls until the commit, and which an abort goes back to.
        self._targets = [*model.weights, *self.optimizer.variables]
        self._kept = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in self._targets]

        def keep():
            for kept, v in zip(self._kept, self._targets):
                kept.assign(v)  # read before any update after it (automatic control dependencies order them)

        def undo():
            for kept, v in zip(self._kept, self._targets):
                v.assign(kept)

        # A step's average is applied in the same call as the next step's gradient is computed
        # (`lease_step_after`): each call costs a small model about as much as its work. Variables are read after
        # they are updated (automatic control dependencies).
        def lease_step(data, begin, end):
            return loss_and_gradient(sliced(data, begin, end))

        def lease_step_after(keeping):
            def step(flat, data, begin, end):
                if keeping:
                    keep()
                apply_mean(flat)
                return loss_and_gradient(sliced(data, begin, end))

            return tf.function(step)

        # Steps of a run in one call (`run_steps`): the call's fixed cost here is several times a small model's step
        # (0.3-0.9 ms against 0.1 ms a step in a loop), a Python callback between steps about 0.05 ms. After each
        # step's gradient the callback does the rest of the step (the collective among it) and hands back the
        # average to apply and the next minibatch's bounds, or stops the loop.
        def run_loop(flat, data, begin, end, keeping):
            if keeping:  # the loop's first apply is the run's first: what it is applied to is kept first
                keep()

            def body(flat, begin, end, going):
                apply_mean(flat)
                loss, grad = loss_and_gradient(sliced(data, begin, end))
                flat, begin, end, going = tf.numpy_function(
                    self._step_done, [loss, grad], [tf.float32, tf.int64, tf.int64, tf.bool], stateful=True
                )
                flat.set_shape([self.size])
                begin.set_shape([1])
                end.set_shape([1])
                going.set_shape([])
                return flat, begin, end, going

            tf.while_loop(lambda *loop: loop[-1], body, [flat, begin, end, tf.constant(True)])

        def applying(keeping):
            def apply(flat):
                if keeping:
                    keep()
                apply_mean(flat)

            # Concrete: a call skips matching its arguments against traces.
            return tf.function(apply).get_concrete_function(tf.TensorSpec([self.size], tf.float32))

        self._grad_step = grad_step
        # by the step applied before it: None (none), False (one, after the first of a run), True (the first)
        self._lease_steps = {None: tf.function(lease_step), **{k: lease_step_after(k) for k in (False, True)}}
        self._apply = {keeping: applying(keeping) for keeping in (False, True)}
        self._run_loop = tf.function(run_loop)
        self._looped = None  # (input specs, `run_loop` traced for them, or None: it cannot be)
        self._on_step = None  # while `run_steps` runs: the rest of each step (see there)
        self._left: tuple | None = None  # what the last `_on_step` left: (average, rate) to apply, or None
        self._step_error: BaseException | None = None
        self._keep, self._undo = tf.function(keep), tf.function(undo)
        self._pending: tuple[np.ndarray, float] | None = None  # a step's average (and rate) not applied yet
        self._kept_holds = False  # `_kept` holds the committed state, steps are applied beyond it
        self._lock = threading.RLock()  # the state's reader (PullState) against the training thread
        # Held to end a run's kept state (commit, undo, a state loaded): a reader of the kept state holds it instead of
        # `_lock`, which the training thread holds for a whole run in one call (`run_steps`), its collectives included.
        self._kept_lock = threading.Lock()
        self._flat_weights = tf.function(flat_weights)
        self._traced = None  # (input specs, {applied before: lease step traced for them})
        self._bound_spec = tf.TensorSpec([1], tf.int64)
        self._checksum: int | None = None  # of the weights as they are, when known
        self._lr_scale: float | None = None  # the factor last set

    def feed(self, rows: dict[str, np.ndarray]):
        """The user's feed() once on a whole lease's records, as `fit` feeds a whole array, as tensors: each
        minibatch is then a slice of them, taken inside the compiled step (`lease_gradients`). None when feed()'s
        output is not row-aligned (a leaf whose first dimension is not the number of records): each minibatch is
        then fed on its own (`gradients`)."""
        tf = self.tf
        features, labels, weights = self.model_def.examples(rows, self.weight_column)
        data = (features, labels) if weights is None else (features, labels, weights)
        n = len(next(iter(rows.values()))) if rows else 0
        if not all(getattr(leaf, "shape", None) and leaf.shape[0] == n for leaf in tf.nest.flatten(data)):
            return None
        data = tf.nest.map_structure(tf.convert_to_tensor, data)
        return data, tf.nest.map_structure(lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), data)

    def lease_gradients(
        self, fed, lo: int, hi: int, where=None, profile=None
    ) -> tuple[float, np.ndarray, int, str | None]:
        """As `gradients`, of records [lo, hi) (offsets) of a lease fed once (`feed`)."""
        tf = self.tf
        t = time.perf_counter()
        data, specs = fed
        if self._traced is None or self._traced[0] != specs:
            self._traced = (specs, {})
        bounds = (data, tf.constant([lo], tf.int64), tf.constant([hi], tf.int64))
        with self._lock:
            after = None
            if self._pending is not None:  # applied in this call
                (mean, lr_scale), self._pending = self._pending, None
                after = self._ready_for(lr_scale)
                bounds = (mean, *bounds)
            step = self._traced[1].get(after)
            if step is None:
                # Traced once for any minibatch and lease size: a concrete function skips the per-call matching of
                # arguments against traces, a noticeable share of a small model's step.
                mean_spec = [] if after is None else [tf.TensorSpec([self.size], tf.float32)]
                step = self._traced[1][after] = self._lease_steps[after].get_concrete_function(
                    *mean_spec, specs, self._bound_spec, self._bound_spec
                )
                # With the run's first step, before the member's first commit (its start-up bound, master/hang.py),
                # not mid-run, between two commits.
                self._loop_for(specs)
            try:
                loss, flat = step(*bounds)
            except Exception as e:  # the user's model/loss failed on real data
                raise self.model_def.user_error(e, "computing a training step", where=str(where or "")) from e
            if after is not None:
                self._kept_holds = True
        return self._checked(loss, flat, hi - lo, where, profile, t)

    def run_steps(self, fed, lo: int, hi: int, on_step, where) -> bool:
        """The steps of a run from records [lo, hi) (offsets) of a lease fed once, in one call, the pending average
        applied first: after each step's gradient, `on_step(loss, flat)` (numpy, on one of TensorFlow's threads, the
        trainer's lock held for it: it takes none) does the rest of the step and returns (average, rate,
        (lo, hi)) to go on with the next minibatch, (average, rate, None) to stop with that average pending, or
        None to stop with nothing pending (the step is trained again, outside). What it raises is raised here;
        `where()`: the records being trained, to name them in the user's error. False, having done nothing, unless
        an average is pending at the rate set (the first applied in the call keeps the state, if a run's first)."""
        tf = self.tf
        data, specs = fed
        with self._lock:
            loop = self._loop_for(specs)
            if loop is None or self._pending is None or self._pending[1] != self._lr_scale:
                return False
            (mean, _), self._pending, self._checksum = self._pending, None, None
            self._on_step, self._left, self._step_error = on_step, None, None
            bounds = tf.constant([lo], tf.int64), tf.constant([hi], tf.int64)
            try:
                loop(tf.constant(mean), data, *bounds, tf.constant(not self._kept_holds))
            except tf.errors.OpError as e:
                if self._step_error is None:  # the user's model/loss failed on real data
                    raise self.model_def.user_error(e, "computing a training step", where=str(where())) from e
            finally:
                self._on_step = None
            if self._step_error is not None:
                raise self._step_error
            self._pending = self._left
        return True

    def _loop_for(self, specs):
        """`run_loop` traced once for any lease and minibatch size, as the lease step is; None when this model or
        optimizer cannot run in a compiled loop (its steps then take a call each, as before)."""
        if self._looped is None or self._looped[0] != specs:  # specs hold dicts: compared, as `_traced`, not hashed
            tf = self.tf
            try:
                loop = self._run_loop.get_concrete_function(
                    tf.TensorSpec([self.size], tf.float32),
                    specs,
                    self._bound_spec,
                    self._bound_spec,
                    tf.TensorSpec([], tf.bool),
                )
            except Exception as e:  # noqa: BLE001 - the ordinary path trains it, one call a step
                log.info("a run's steps take one call each: they cannot run in one compiled loop (%s)", e)
                loop = None
            self._looped = (specs, loop)
        return self._looped[1]

    def _step_done(self, loss, flat):
        """`run_steps`'s callback, from the compiled loop: never raises (TensorFlow would wrap it), keeps it."""
        stop = (np.zeros(self.size, np.float32), np.zeros(1, np.int64), np.zeros(1, np.int64), np.bool_(False))
        if not self._kept_holds:  # the loop kept the state before its first apply: readers may read it from now on
            with self._kept_lock:
                self._kept_holds = True
        try:
            done = self._on_step(float(loss), flat)
        except BaseException as e:  # noqa: BLE001 - raised by run_steps, in the caller's thread
            self._step_error = e
            return stop
        if done is None:
            return stop
        mean, lr_scale, bounds = done
        if bounds is None or lr_scale != self._lr_scale:
            self._left = (mean, lr_scale)
            return stop
        lo, hi = bounds
        return mean.astype(np.float32, copy=False), np.array([lo], np.int64), np.array([hi], np.int64), np.bool_(True)

    def gradients(self, batch, where=None, profile=None) -> tuple[float, np.ndarray, int, str | None]:
        """(loss, flat gradient, records, None) of one minibatch; `where`: its records (worker/records.py). When its
        loss or gradient is not finite, fails, or, when skipping such minibatches, returns why in the last place."""
        tf = self.tf
        t = time.perf_counter()
        features, labels, weights = self.model_def.examples(batch, self.weight_column)
        data = (features, labels) if weights is None else (features, labels, weights)
        # Tensors, as fit makes them: numpy arrays and tensors mixed in one structure (a string column made
        # a tensor by feed()) are then one kind of input.
        data = tf.nest.map_structure(tf.convert_to_tensor, data)
        if profile is not None:
            t = profile.add("read+feed", t)
        with self._lock:
            self._flush()
        try:
            loss, flat = self._grad_step(data)
        except Exception as e:  # the user's model/loss failed on real data
            raise self.model_def.user_error(e, "computing a training step", where=str(where or "")) from e
        return self._checked(loss, flat, len(next(iter(batch.values()))), where, profile, t)

    def _checked(self, loss, flat, n: int, where, profile, t: float) -> tuple[float, np.ndarray, int, str | None]:
        loss, flat = float(loss), flat.numpy()
        # Before the ring: no member applies an average that holds it. One pass over the buffer when all is
        # finite (every step); per variable, to name it, only when not.
        skipped = None
        if not (math.isfinite(loss) and np.isfinite(flat).all()):
            skipped = self.non_finite.check(loss, np.split(flat, self._offsets), where, self._names)
        if profile is not None:
            profile.add("compute", t)
        return loss, flat, n, skipped

    def apply(self, mean_grad: np.ndarray, lr_scale: float) -> None:
        """The step's mean gradient, through the user's optimizer at its learning rate × `lr_scale`, before the
        master commits it: the state before the first step not committed is kept until `commit` (the master
        committed them) or `undo` (it aborted them), and `state()` is that kept one meanwhile. Applied in the next
        minibatch's call (`lease_gradients`), or by whatever reads the weights first."""
        with self._lock:
            self._flush()
            self._pending, self._checksum = (mean_grad, lr_scale), None

    def _ready_for(self, lr_scale: float) -> bool:
        """Before the pending step is applied (lock held): its rate set. True when the call must keep the state
        first (the run's first step)."""
        keeping = not self._kept_holds
        if lr_scale != self._lr_scale:
            if keeping:
                self._keep()  # before the rate changes: a float rate is optimizer state
                keeping, self._kept_holds = False, True
            self._set_lr_scale(lr_scale)
        return keeping

    def _flush(self) -> None:
        """The pending step applied on its own (lock held)."""
        if self._pending is not None:
            (mean, lr_scale), self._pending = self._pending, None
            self._apply[self._ready_for(lr_scale)](mean)
            self._kept_holds = True

    def commit(self) -> None:
        with self._lock:
            self._flush()
            with self._kept_lock:
                self._kept_holds = False

    def undo(self) -> None:
        """Back to the committed state (its learning rate too: a float rate is optimizer state)."""
        with self._lock:
            self._pending = None
            if self._kept_holds:
                self._undo()
                with self._kept_lock:
                    self._kept_holds = False
            self._checksum = None
            self._lr_scale = None  # a schedule's factor is not optimizer state: set anew at the next apply

    def _set_lr_scale(self, lr_scale: float) -> None:
        if lr_scale != self._lr_scale:  # an assignment per step is a noticeable share of a small model's
            self.lr_scale.set(lr_scale)
            self._lr_scale = lr_scale

    def checksum(self) -> int:
        """Of the weights as they are, every step applied (the master compares the members' at each commit)."""
        with self._lock:
            self._flush()
            if self._checksum is None:
                self._checksum = zlib.crc32(self._flat_weights().numpy().tobytes())
            return self._checksum

    def state(self) -> tuple[int, list[np.ndarray], dict]:
        """The committed state: while steps are applied that are not, the one they were applied to (kept aside, which
        nothing changes until the run commits or is undone: read without waiting for a run in one call)."""
        with self._kept_lock:
            kept = self._kept_holds
            if kept:
                values = [np.asarray(v.numpy()) for v in self._kept]
        if not kept:
            with self._lock:
                values = [np.asarray(v.numpy()) for v in (self._kept if self._kept_holds else self._targets)]
        return len(self.model.weights), values, self.applied_records.arrays()

    def load_state(self, num_model: int, values: list[np.ndarray], applied: dict, there: str = "a peer's state"):
        """A peer's state (`there` names it: a peer, a checkpoint): its weights, its optimizer's, and the records they
        hold, which travel with them. Refused, naming the variable, unless every value has its variable's shape and
        dtype."""
        targets = list(self.model.weights) + list(self.optimizer.variables)
        here = [(v.path, tuple(v.shape), v.dtype) for v in targets]
        saved = [(a.shape, a.dtype) for a in values]
        mismatch = layout_mismatch(here, saved, there)
        if mismatch is None and num_model != len(self.model.weights):
            mismatch = f"this model has {len(self.model.weights)} weights, {there} {num_model}"
        if mismatch is not None:
            raise ConfigError(f"Cannot load {there}: {mismatch}: {CHANGED_MODEL}. {CHANGED_MODEL_FIX}")
        with self._lock:
            with self._kept_lock:
                self._kept_holds = False
            for var, value in zip(targets, values):
                var.assign(value)
            self._checksum = self._lr_scale = self._pending = None  # the loaded values hold their own rate
        self.applied_records = AppliedRecords.of(applied)


class StepProfile:
    """Where this member's steps spent their time, by phase, in seconds: logged when it stops training, for
    anyone tuning a job (docs/benchmarks.md reads it). A few clock reads per step."""

    PHASES = ("read+feed", "compute", "collective", "step ready", "apply", "lease")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0
        self.looped = 0  # of `steps`, those taken inside a run's one call (AllReduceTrainer.run_steps)
        self.runs = 0  # runs that ended in a `StepReady`
        self.started = time.perf_counter()

    def add(self, phase: str, since: float) -> float:
        """Charge the time since `since` to `phase`; returns now, the next phase's start."""
        now = time.perf_counter()
        self.seconds[phase] += now - since
        return now

    def __str__(self) -> str:
        wall = time.perf_counter() - self.started
        per = {k: 1e3 * v / max(1, self.steps) for k, v in self.seconds.items()}
        other = 1e3 * (wall - sum(self.seconds.values())) / max(1, self.steps)
        head = f"{self.steps} steps in {self.runs} runs ({self.looped} in a run's one call) in {wall:.1f} s"
        return f"{head}, ms per step: " + ", ".join([*(f"{k} {v:.3f}" for k, v in per.items()), f"other {other:.3f}"])


class Lease:
    def __init__(self, t: pb.Task):
        self.task_id, self.shard, self.task_start, self.end = t.task_id, t.shard, t.task_start, t.end
        self.epoch, self.shard_index = t.epoch, t.shard_index
        self.watermark = t.start  # committed
        self.at = t.start  # trained to, in steps applied (committed or not)
        self.fed = None  # its records from `fed_from` on, fed (AllReduceTrainer.feed); False: fed per minibatch
        self.fed_from = t.start

    def minibatch_end(self, lo: int, minibatch_size: int) -> int:
        """The end of the minibatch that holds record `lo` (data.api.minibatch_end)."""
        return minibatch_end(self.task_start, self.end, lo, minibatch_size)


# A member's contribution to a step, (epoch, data shard, start, end), rides in the allreduced buffer:
# each member writes it into its rank's slot, zeros elsewhere, so the sum hands every member all of
# them. Each integer is two float32s (high and low 20 bits), exact below 2**44.
SLOT = 8
_LOW = 1 << 20


def contribution_slots(contribution: tuple[int, int, int, int] | None, rank: int, world: int) -> np.ndarray:
    slots = np.zeros(SLOT * world, np.float32)
    if contribution is not None:
        ints = np.array(contribution, np.int64)
        slots[SLOT * rank : SLOT * (rank + 1)] = np.stack([ints // _LOW, ints % _LOW], 1).ravel()
    return slots


def contributions(slots: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Every member's (epoch, data shard, start, end) in a step, from the allreduced slots. A skipped minibatch's
    data shard is its complement (data/api.py, skipped_key)."""
    pairs = np.rint(slots).astype(np.int64).reshape(-1, 4, 2)
    ints = pairs[:, :, 0] * _LOW + pairs[:, :, 1]
    return [tuple(int(x) for x in c) for c in ints if c[3] > c[2]]


def step_lr_scale(global_batch: str, taken: list[tuple[int, int, int, int]], max_workers: int) -> float:
    """The factor on the optimizer's learning rate for a step that took `taken` (contributions()). `scaled`: the
    global batch is that of the members that trained a minibatch in the step, and the rate follows it. A step that
    one member trains alone (its lease outlasting the others' at an epoch's end) is a smaller batch: at the full
    rate it would train those records harder than `fit` does. `fixed`: left alone."""
    if global_batch != "scaled":
        return 1.0
    trained = sum(1 for _epoch, data_shard, _lo, _hi in taken if data_shard >= 0)  # skipped ones trained nothing
    return trained / max(1, max_workers)


# A run commits at most this many steps, or this long after its start: the master hears of progress (the ledger's
# watermarks, the members' paces and hang clocks) and admits newcomers at least that often.
RUN_STEPS = 16
RUN_S = 0.1


class Run:
    """The steps applied since the last commit, which the master commits (or aborts) at once."""

    def __init__(self, committed_step: int):
        self.step = committed_step  # the last applied
        self.first = committed_step + 1
        self.steps = self.records = 0
        self.loss_sum = 0.0
        self.compute_s: list[float] = []  # this member's own time for each step's minibatches
        self.taken: list[tuple[int, int, int, int]] = []  # every member's contributions (contributions())
        self.moved = False  # this member's watermark moved (its records, or a minibatch it skipped)
        self.started = time.monotonic()

    def add(self, step: int, taken: list, records: int, loss: float, compute_s: float) -> None:
        if not self.steps:
            self.started = time.monotonic()
        self.step = step
        self.steps += 1
        self.taken += taken
        self.compute_s.append(compute_s)
        if records:
            self.records += records
            self.loss_sum += loss * records

    def full(self) -> bool:
        """With the step being trained, long enough to commit."""
        return self.steps + 1 >= RUN_STEPS or (self.steps > 0 and time.monotonic() - self.started >= RUN_S)

    def loss(self) -> float:
        return self.loss_sum / self.records if self.records else 0.0


class AllReduceWorker:
    def __init__(
        self,
        master: MasterClient,
        token: str,
        trainer: AllReduceTrainer,
        readers,
        ring: Ring,
        state: StateProvider,
        address: str,
        minibatch_size: int,
        global_batch: str,
        stop: threading.Event,
    ):
        self.master, self.token, self.trainer, self.readers = master, token, trainer, readers
        self.ring, self.state, self.address = ring, state, address
        self.minibatch_size, self.global_batch, self.stop = minibatch_size, global_batch, stop
        self.me = f"{master.me.role}-{master.me.index}"
        self.view: pb.MembershipReply | None = None
        self.lease: Lease | None = None
        self.applied_step = -1  # the step whose state this worker's weights are (-1: none yet)
        self.profile = StepProfile()
        self.restored_from = 0  # the checkpoint whose state this worker loaded from the master
        self._last_poll = 0.0

    # ------------------------------------------------------------------ master calls
    def membership(self, known: int = -1, wait_s: float = 0.0) -> pb.MembershipReply:
        return rpc.call(
            self.master.stub.GetMembership,
            pb.MembershipRequest(token=self.token, instance=self.master.me, known_version=known, wait_s=wait_s),
        )

    def abort_check(self) -> None:
        """Called while waiting for a chunk: has the membership moved on?"""
        now = time.monotonic()
        if now - self._last_poll < 0.05:
            return
        self._last_poll = now
        v = self.membership()
        if v.version != self.view.version or v.state != MR.MEMBER:
            self.view = v
            raise Aborted(f"membership is now version {v.version}")

    def report_peer(self, err: PeerFailed) -> None:
        log.warning("peer %s failed in version %d: %s", err.peer, self.view.version, err.detail)
        try:
            rpc.call(
                self.master.stub.ReportPeerFailure,
                pb.PeerFailureReport(
                    token=self.token,
                    instance=self.master.me,
                    version=self.view.version,
                    peer=err.peer,
                    detail=err.detail[:500],
                ),
                timeout=10,
                retry_for=10,
            )
        except grpc.RpcError:
            log.exception("could not report the peer failure")

    # ------------------------------------------------------------------ joining
    def join(self) -> bool:
        """Register, wait to be admitted, take the state from rank 0. False when training is over."""
        self.lease = None
        self.master.register(self.address)
        known = -1
        while not self.stop.is_set():
            v = self.membership(known, wait_s=0.5)
            known = v.version
            if v.state == MR.DONE:
                return False
            if v.state == MR.EVICTED:
                self.master.register(self.address)
                continue
            if v.state != MR.MEMBER:
                continue
            self.view = v
            if self.sync_state():
                return True
        return False

    def sync_state(self) -> bool:
        """Make this member's weights those of the version's base step (pull them if needed)."""
        v = self.view
        if v.restore_checkpoint and self.restored_from != v.restore_checkpoint:
            return self.load_checkpoint()
        if v.rank == 0 or self.applied_step == v.base_step:
            if self.applied_step < 0:
                self.applied_step = v.base_step  # rank 0 of the very first version: its own init
                self.state.set_applied(self.applied_step)
            return True
        peer, address = v.members[0].name, v.members[0].address
        try:
            state = pull_state(address, self.token, v.base_step)
        except grpc.RpcError as e:
            log.warning("could not pull the state of step %d from %s: %s", v.base_step, peer, e.code().name)
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self.report_peer(PeerFailed(peer, f"PullState: {e.code().name}"))
            time.sleep(0.05)
            return False
        self.take_state(state, f"the state of step {v.base_step} of {peer}")
        log.info(
            "pulled the state of step %d from %s (version %d, rank %d of %d)",
            state.step,
            peer,
            v.version,
            v.rank,
            len(v.members),
        )
        return True

    def take_state(self, state: tensors.MemberState, there: str) -> None:
        """Another copy's state (a peer's, or a checkpoint's: `there`) becomes this member's, under the state lock."""
        with self.state.cv:
            self.trainer.load_state(state.num_model, state.values, state.applied, there)
            self.applied_step = state.step
            self.state.applied_step = state.step
            self.state.cv.notify_all()

    def load_checkpoint(self) -> bool:
        """A resumed job's first version: the checkpoint's state, from the master."""
        v = self.view
        try:
            state = tensors.decode_state(
                self.master.stub.PullCheckpointState(pb.StateRequest(token=self.token, step=v.base_step), timeout=60)
            )
        except grpc.RpcError as e:
            log.warning("could not load checkpoint %d's state from the master: %s", v.restore_checkpoint, e.code().name)
            time.sleep(0.2)
            return False
        self.take_state(state, f"checkpoint {v.restore_checkpoint}")
        self.restored_from = v.restore_checkpoint
        self.lease = None  # a lease of the previous master's ledger means nothing to this one
        log.info(
            "loaded checkpoint %d's state (step %d) from the master (version %d, rank %d of %d)",
            v.restore_checkpoint,
            state.step,
            v.version,
            v.rank,
            len(v.members),
        )
        return True

    # ------------------------------------------------------------------ steps
    def take_lease(self) -> str:
        """'ok' with a lease, 'none' (no data this step), or 'done'."""
        if self.lease is not None and self.lease.at < self.lease.end:
            return "ok"
        self.lease = None
        reply = self.master.get_task()
        if reply.kind == pb.GetTaskResponse.DONE:
            return "done"
        if reply.kind == pb.GetTaskResponse.TASK:
            self.lease = Lease(reply.task)
            return "ok"
        return "none"

    def fed_lease(self):
        """The lease's records from its watermark on, read and fed once (trainer.feed), or None when feed() is not
        row-aligned (each minibatch is then read and fed on its own)."""
        lease = self.lease
        if lease.fed is None:
            t = time.perf_counter()
            at = Records(lease.shard, lease.shard_index, lease.epoch, lease.at, lease.end)
            with working_on(at):
                lease.fed = self.trainer.feed(self.readers.read(lease.shard, lease.at, lease.end)) or False
            lease.fed_from = lease.at
            self.profile.add("read+feed", t)
        return lease.fed or None

    def compute(self, world: int, step: int, start: int):
        """(flat buffer to allreduce, watermark after, records, loss, this member's contribution) for
        this step's minibatches, from offset `start` of its lease: one range of it, (epoch, data shard, start, end),
        or None. A minibatch
        skipped (--skip-non-finite) is a step's contribution of its own, under its data shard's complement: the
        minibatches before it make this step's, it makes the next."""
        k = 1 if self.global_batch == "scaled" else max(1, math.ceil(self.view.max_workers / world))
        buf = np.zeros(self.trainer.size + 2, np.float32)
        records, loss_sum, data_shard = 0, 0.0, self.lease.shard_index if self.lease else 0
        hi = start
        for _ in range(k):
            if self.lease is None or hi >= self.lease.end:
                break
            lo = hi
            hi = self.lease.minibatch_end(lo, self.minibatch_size)
            at = Records(self.lease.shard, self.lease.shard_index, self.lease.epoch, lo, hi)
            fed = self.fed_lease()
            with working_on(at):
                if fed is not None:
                    loss, flat, n, skipped = self.trainer.lease_gradients(
                        fed, lo - self.lease.fed_from, hi - self.lease.fed_from, at, self.profile
                    )
                else:
                    t = time.perf_counter()
                    rows = self.readers.read(self.lease.shard, lo, hi)
                    self.profile.add("read+feed", t)
                    loss, flat, n, skipped = self.trainer.gradients(rows, at, self.profile)
            if skipped is not None:
                if records:  # the next step's
                    hi = lo
                else:
                    data_shard = skipped_key(self.lease.epoch, data_shard)[1]
                    self.master.report_skipped(at, skipped, step)
                break
            buf[:-2] += flat * n
            records += n
            loss_sum += loss * n
        buf[-2], buf[-1] = records, loss_sum
        consumed = self.lease is not None and hi > start
        contribution = (self.lease.epoch, data_shard, start, hi) if consumed else None
        return buf, hi, records, (loss_sum / records if records else float("nan")), contribution

    def computed(self, step: int, start: int) -> tuple:
        """(step, the checkpoint restored from, *compute(), compute_s): a step's minibatches, kept across retries of
        the step but not across a restore (its lease and weights were a previous master's)."""
        started = time.monotonic()
        done = self.compute(len(self.view.members), step, start)
        faults.STEP_DONE(time.monotonic() - started)
        # Its own pace, which the master cannot see otherwise: the collective ends every member's step together
        # (master/ring_straggler.py).
        return (step, self.restored_from, *done, time.monotonic() - started)

    def run_ready(self, request: pb.StepReadyRequest) -> pb.StepReadyReply:
        """The master's COMMIT or ABORT of a run, asked again while it says WAIT (its long poll ended)."""
        while True:
            reply = rpc.call(self.master.stub.StepReady, request)
            if reply.kind != pb.StepReadyReply.WAIT:
                return reply

    def share(self, run: Run, step: int, buf, watermark, records, loss, contribution, compute_s) -> tuple:
        """A step computed (`computed`): its collective, and the run and lease told. (average, rate, whether the run
        ends here); the average None when no member trained a record. Raises PeerFailed or Aborted."""
        v = self.view
        lease_ends = self.lease is None or not contribution or watermark >= self.lease.end
        payload = np.concatenate(
            [buf, contribution_slots(contribution, v.rank, len(v.members)), [float(lease_ends or run.full())]]
        )
        t = time.perf_counter()
        members = [(m.name, m.address) for m in v.members]
        total = self.ring.allreduce(payload, members, v.version, step, self.abort_check)
        total, slots, ends = total[: buf.size], total[buf.size : -1], total[-1] > 0
        self.profile.add("collective", t)
        n = float(total[-2])
        taken = contributions(slots)
        self.profile.steps += 1
        run.add(step, taken, records, loss, compute_s)
        if self.lease is not None and contribution:
            self.lease.at = watermark
            run.moved = True
        return (total[:-2] / n if n > 0 else None), step_lr_scale(self.global_batch, taken, v.max_workers), ends

    def fusable(self, world: int) -> bool:
        """Whether the run's next steps can run in one call (`run_fused`): one minibatch a step, of a lease fed once
        with records left."""
        lease = self.lease
        one = self.global_batch == "scaled" or math.ceil(self.view.max_workers / world) == 1
        return one and lease is not None and bool(lease.fed) and lease.at < lease.end

    def run_fused(self, run: Run) -> bool | None:
        """The run's next steps in one call (trainer.run_steps), the previous step's average applied first, until the
        run ends (True), or a step must go the ordinary way (False): a rate that changes, a minibatch that is not
        finite (trained again there, where --skip-non-finite applies), the worker stopping. None: nothing done (no
        average pending at the rate set). Raises PeerFailed or Aborted."""
        lease, mb = self.lease, self.minibatch_size
        bounds = [lease.at, lease.minibatch_end(lease.at, mb)]
        clock = [time.monotonic(), time.perf_counter()]
        ends = [False]

        def records() -> Records:
            return Records(lease.shard, lease.shard_index, lease.epoch, *bounds)

        def on_step(loss: float, flat: np.ndarray):
            compute_s = time.monotonic() - clock[0]
            faults.STEP_DONE(compute_s)
            self.profile.add("compute", clock[1])
            lo, hi = bounds
            if not (math.isfinite(loss) and np.isfinite(flat).all()):
                return None
            n = hi - lo
            buf = np.empty(flat.size + 2, np.float32)
            np.multiply(flat, n, out=buf[:-2])
            buf[-2], buf[-1] = n, loss * n
            contribution = (lease.epoch, lease.shard_index, lo, hi)
            # Its own records are in the sum: the average is never None here.
            mean, lr_scale, ends[0] = self.share(run, run.step + 1, buf, hi, n, loss, contribution, compute_s)
            self.profile.looped += 1
            go_on = not (ends[0] or self.stop.is_set())
            if go_on:
                bounds[:] = [hi, lease.minibatch_end(hi, mb)]
            clock[:] = [time.monotonic(), time.perf_counter()]
            return mean, lr_scale, (bounds[0] - lease.fed_from, bounds[1] - lease.fed_from) if go_on else None

        # Without the state's condition: the trainer's lock, held for the call, orders it against the state's writers;
        # readers of the kept state do not wait for it (AllReduceTrainer.state).
        lo, hi = bounds[0] - lease.fed_from, bounds[1] - lease.fed_from
        if not self.trainer.run_steps(lease.fed, lo, hi, on_step, records):
            return None
        return ends[0]

    def run(self) -> str:
        if not self.join():
            return "done"
        self.profile = StepProfile()  # from the first step on: not the wait to be admitted
        computed = None  # see `computed`
        run = Run(self.applied_step)
        while not self.stop.is_set():
            step = run.step + 1
            v = self.view
            try:
                ends = self.run_fused(run) if run.steps and self.fusable(len(v.members)) else None
                if ends is not None:
                    computed = None  # a run's first step only is kept for a retry
                else:
                    if computed is None or computed[:2] != (step, self.restored_from):
                        if not run.steps:  # a lease is taken between runs: a run ends where this member's lease does
                            t = time.perf_counter()
                            status = self.take_lease()
                            self.profile.add("lease", t)
                            if status == "done":
                                return "done"
                        computed = self.computed(step, self.lease.at if self.lease else 0)
                    mean, lr_scale, ends = self.share(run, step, *computed[2:])
                    t = time.perf_counter()
                    # Applied at once (the average is identical on every member), before the master commits the run.
                    if mean is not None:
                        with self.state.cv:
                            self.trainer.apply(mean, lr_scale)
                    self.profile.add("apply", t)
            except (PeerFailed, Aborted) as e:
                if isinstance(e, PeerFailed):
                    self.report_peer(e)
                else:
                    log.info("step %d aborted in version %d: %s", run.step + 1, v.version, e)
                self.undo()
                if not self.rejoin_or_resync():
                    return "done"
                run = Run(self.applied_step)
                continue
            step = run.step
            if not ends:
                continue
            t = time.perf_counter()
            reply = self.run_ready(
                pb.StepReadyRequest(
                    token=self.token,
                    instance=self.master.me,
                    version=v.version,
                    step=step,
                    task_id=self.lease.task_id if (self.lease and run.moved) else -1,
                    watermark=self.lease.at if self.lease else 0,
                    records=run.records,
                    loss=run.loss(),
                    checksum=self.trainer.checksum(),
                    compute_s=sum(run.compute_s),
                    steps=run.steps,
                    step_compute_s=run.compute_s,
                )
            )
            self.profile.add("step ready", t)
            self.profile.runs += 1
            if reply.kind == pb.StepReadyReply.ABORT:
                log.info(
                    "steps %d-%d aborted by the master (version %d -> %d): retrying",
                    run.first,
                    step,
                    v.version,
                    reply.membership.version,
                )
                self.undo()
                self.view = reply.membership
                if not self.rejoin_or_resync():
                    return "done"
                run = Run(self.applied_step)
                continue
            # COMMIT: the run's state is the committed one now.
            with self.state.cv:
                self.trainer.commit()
                for epoch, data_shard, start, end in run.taken:  # skipped ones too
                    self.trainer.applied_records.add(epoch, data_shard, start, end)
                self.applied_step = step
                self.state.applied_step = step
                self.state.cv.notify_all()
            if self.lease is not None:
                self.lease.watermark = self.lease.at
            run = Run(step)
            self.view = reply.membership
            if reply.done:
                return "done"
            if self.view.state != MR.MEMBER:
                if not self.rejoin_or_resync():
                    return "done"
                run = Run(self.applied_step)
        return "stopped"

    def undo(self) -> None:
        """A run aborted: back to the committed state, and to the lease's committed watermark."""
        with self.state.cv:
            self.trainer.undo()
        if self.lease is not None:
            self.lease.at = self.lease.watermark

    def rejoin_or_resync(self) -> bool:
        """After an abort: refresh the membership; rejoin if evicted, pull state if needed."""
        while not self.stop.is_set():
            v = self.membership()
            if v.state == MR.DONE:
                return False
            if v.state in (MR.EVICTED, MR.PENDING, MR.WAITING):
                log.warning("no longer a member (state %s): rejoining", MR.State.Name(v.state))
                return self.join()
            self.view = v
            if self.sync_state():
                return True
        return False
