"""An allreduce member's trainer: the model, the user's optimizer and the member's compiled steps (step.py), with
the state a run of steps is applied beyond and goes back to. A step's average is applied before the master commits
it: the state the run's first step was applied to is kept aside until `commit` (the master committed the run) or
`undo` (it aborted it), and `state()`, which a peer or a checkpoint pulls, is that kept one meanwhile."""

from __future__ import annotations

import logging
import math
import threading
import time
import zlib

import numpy as np

from elastic_step.data.accounting import AppliedRecords
from elastic_step.errors import ConfigError
from elastic_step.optimizers import LearningRateScale
from elastic_step.ps.api import CHANGED_MODEL, CHANGED_MODEL_FIX, layout_mismatch
from elastic_step.worker.allreduce.step import build_steps
from elastic_step.worker.finite import NonFinite
from elastic_step.worker.loss_scale import overflowed

log = logging.getLogger("elastic_step.worker")


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
        loss_scaling = model_def.loss_scaling(model)
        self.loss_scaled = loss_scaling is not None
        steps = build_steps(model_def, model, self.optimizer, self._step_done, loss_scaling)
        self.size = steps.size
        sizes = [int(v.shape.num_elements()) for v in trainable]
        self._offsets, self._names = np.cumsum(sizes)[:-1], [v.path for v in trainable]
        # Steps are applied before the master commits them, a run of steps at a time (member.py). What the first was
        # applied to is kept aside, in variables of the same shapes: the committed state, which a peer or a
        # checkpoint pulls until the commit, and which an abort goes back to.
        self._targets, self._kept = steps.targets, steps.kept
        self._grad_step = steps.grad_step
        # by the step applied before it: None (none), False (one, after the first of a run), True (the first)
        self._lease_steps = steps.lease_steps
        self._apply = steps.apply
        self._run_loop = steps.run_loop
        self._looped = None  # (input specs, `run_loop` traced for them, or None: it cannot be)
        self._on_step = None  # while `run_steps` runs: the rest of each step (see there)
        self._left: tuple | None = None  # what the last `_on_step` left: (average, rate) to apply, or None
        self._step_error: BaseException | None = None
        self._keep, self._undo = steps.keep, steps.undo
        self._pending: tuple[np.ndarray, float] | None = None  # a step's average (and rate) not applied yet
        self._kept_holds = False  # `_kept` holds the committed state, steps are applied beyond it
        self._lock = threading.RLock()  # the state's reader (PullState) against the training thread
        # Held to end a run's kept state (commit, undo, a state loaded): a reader of the kept state holds it instead of
        # `_lock`, which the training thread holds for a whole run in one call (`run_steps`), its collectives included.
        self._kept_lock = threading.Lock()
        self._flat_weights = steps.flat_weights
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
        if not self.goes_to_the_ring(loss, flat):
            skipped = self.non_finite.check(loss, np.split(flat, self._offsets), where, self._names)
        if profile is not None:
            profile.add("compute", t)
        return loss, flat, n, skipped

    def goes_to_the_ring(self, loss: float, flat: np.ndarray) -> bool:
        """Whether a minibatch's gradient goes to the ring as it is: its loss and gradient are finite or, under loss
        scaling, it overflowed (every member then skips the step: step.py); else it is a non-finite one."""
        if math.isfinite(loss) and np.isfinite(flat).all():
            return True
        return self.loss_scaled and overflowed(loss, [flat])

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
