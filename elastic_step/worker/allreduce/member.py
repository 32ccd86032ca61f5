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
a member's peers and the master's checkpoints pull the kept state, never a partial run. The master is
asked once a run, not once a step: its round trip is a large share of a small model's step
(docs/benchmarks.md, the sync section).
A run's steps after its first run in one compiled call (`AllReduceTrainer.run_steps`): a loop that applies the
last average, computes the next minibatch's gradient and calls back into Python for the rest of the step (the
collective, the run's and lease's bookkeeping), which hands it the next average, or ends the loop at the run's end:
a call's fixed cost is several times a small model's whole step. The run's first step, one that a new rate or a
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

import grpc
import numpy as np

from elastic_step import fault_hooks as faults
from elastic_step.data.accounting import minibatch_end, skipped_key
from elastic_step.instance.collective_client import pull_state
from elastic_step.instance.master_client import MasterClient
from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import rpc, tensors
from elastic_step.worker.allreduce.collective import Aborted, PeerFailed, Ring, StateProvider
from elastic_step.worker.allreduce.trainer import AllReduceTrainer
from elastic_step.worker.records import Records, working_on

log = logging.getLogger("elastic_step.worker")

MR = pb.MembershipReply


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
        """The end of the minibatch that holds record `lo` (data/accounting.py, minibatch_end)."""
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
    data shard is its complement (data/accounting.py, skipped_key)."""
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
        self.step_s = self.ring_s = 0.0  # this launch's time computing its steps, and in the ring's collectives
        self.restored_from = 0  # the checkpoint whose state this worker loaded from the master
        self._last_poll = 0.0
        self._computed: tuple | None = None  # the step's minibatches, computed (`computed`), kept for its retry

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
        self.ring_s += time.perf_counter() - t
        n = float(total[-2])
        taken = contributions(slots)
        self.profile.steps += 1
        run.add(step, taken, records, loss, compute_s)
        self.step_s += compute_s
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
            if not self.trainer.goes_to_the_ring(loss, flat):
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
        self._computed = None  # see `computed`
        run = Run(self.applied_step)
        while not self.stop.is_set():
            v = self.view
            try:
                ends = self.step(run)
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
            if ends is None:
                return "done"
            if not ends:
                continue
            reply = self.ready(run)
            if reply.kind == pb.StepReadyReply.ABORT:
                log.info(
                    "steps %d-%d aborted by the master (version %d -> %d): retrying",
                    run.first,
                    run.step,
                    v.version,
                    reply.membership.version,
                )
                self.undo()
                self.view = reply.membership
                if not self.rejoin_or_resync():
                    return "done"
                run = Run(self.applied_step)
                continue
            self.commit(run)
            run = Run(run.step)
            self.view = reply.membership
            if reply.done:
                return "done"
            if self.view.state != MR.MEMBER:
                if not self.rejoin_or_resync():
                    return "done"
                run = Run(self.applied_step)
        return "stopped"

    def step(self, run: Run):
        """The run's next step (or steps, in one call), trained, shared and applied: whether the run ends there, or
        None when the master has no more data. Raises PeerFailed or Aborted."""
        step = run.step + 1
        ends = self.run_fused(run) if run.steps and self.fusable(len(self.view.members)) else None
        if ends is not None:
            self._computed = None  # a run's first step only is kept for a retry
            return ends
        if self._computed is None or self._computed[:2] != (step, self.restored_from):
            if not run.steps:  # a lease is taken between runs: a run ends where this member's lease does
                t = time.perf_counter()
                status = self.take_lease()
                self.profile.add("lease", t)
                if status == "done":
                    return None
            self._computed = self.computed(step, self.lease.at if self.lease else 0)
        mean, lr_scale, ends = self.share(run, step, *self._computed[2:])
        t = time.perf_counter()
        # Applied at once (the average is identical on every member), before the master commits the run.
        if mean is not None:
            with self.state.cv:
                self.trainer.apply(mean, lr_scale)
        self.profile.add("apply", t)
        return ends

    def ready(self, run: Run) -> pb.StepReadyReply:
        """The run's end: the master's COMMIT or ABORT of it."""
        t = time.perf_counter()
        reply = self.run_ready(
            pb.StepReadyRequest(
                token=self.token,
                instance=self.master.me,
                version=self.view.version,
                step=run.step,
                task_id=self.lease.task_id if (self.lease and run.moved) else -1,
                watermark=self.lease.at if self.lease else 0,
                records=run.records,
                loss=run.loss(),
                checksum=self.trainer.checksum(),
                compute_s=sum(run.compute_s),
                steps=run.steps,
                step_compute_s=run.compute_s,
                step_s=self.step_s,
                wait_s=self.ring_s,
            )
        )
        self.profile.add("step ready", t)
        self.profile.runs += 1
        return reply

    def commit(self, run: Run) -> None:
        """The master committed the run: its state is the committed one now, and the lease's watermark its end."""
        with self.state.cv:
            self.trainer.commit()
            for epoch, data_shard, start, end in run.taken:  # skipped ones too
                self.trainer.applied_records.add(epoch, data_shard, start, end)
            self.applied_step = run.step
            self.state.applied_step = run.step
            self.state.cv.notify_all()
        if self.lease is not None:
            self.lease.watermark = self.lease.at

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
