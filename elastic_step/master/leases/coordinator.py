"""The master's decisions, under one lock: who gets a lease, what a report commits, what a loss requeues, who is
given up, and the membership they rest on. Each decision makes the job's timeline (master/timeline.py).

The gRPC service and the job loop both call into it; it decides nothing about processes (that is the relaunch
policy's job) and never blocks on I/O while holding its lock. The watches it keeps under the lock (master/gray/)
and the figures it feeds (master/pace.py) are plain data that decide nothing by themselves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from elastic_step.backends.api import EventKind, InstanceEvent, InstanceId
from elastic_step.master.gray.fence import Fences
from elastic_step.master.gray.hang import MEASURED, HangBounds, HangWatch, Hung
from elastic_step.master.gray.ring_straggler import RingPaceWatch, Straggler
from elastic_step.master.gray.straggler import StragglerWatch
from elastic_step.master.leases.ledger import Lease, LeaseOver, Ledger, LedgerError
from elastic_step.master.leases.membership import Membership
from elastic_step.master.leases.rendezvous import Rendezvous
from elastic_step.master.pace import Pace
from elastic_step.master.timeline import Timeline

log = logging.getLogger("elastic_step.master")


class Coordinator:
    def __init__(
        self,
        ledger: Ledger,
        num_ps: int,
        min_workers: int = 1,
        bounds: HangBounds = MEASURED,
        timeline: Timeline | None = None,
        ring_max_workers: int | None = None,
        members_lost: Callable[[], bool] = lambda: False,
    ):
        """`timeline`: the job's, where each decision is recorded (a new one by default). `ring_max_workers`:
        --strategy allreduce, the ring's largest size; its rendezvous (versioned membership and atomic step commits)
        decides under this lock. `members_lost` (allreduce, lock held): every member is gone; True once the job's
        checkpoints took it back to the last one."""
        self.lock = threading.Lock()
        self.timeline = timeline or Timeline()
        self.ledger = ledger
        self.membership = Membership()
        self.hangs = HangWatch(bounds)  # the workers' clocks (master/gray/hang.py)
        self.fences = Fences()  # worker launches given up: their calls and pushes are refused (master/gray/fence.py)
        self.stragglers = StragglerWatch()  # ps: whose work an idle worker takes (see master/gray/straggler.py)
        self.ring_paces = RingPaceWatch()  # allreduce: whom the ring leaves out (see master/gray/ring_straggler.py)
        self.retired: set[str] = set()  # workers left out for good: the job trains on without them
        self.num_ps = num_ps
        self.min_workers = min_workers
        self.training_started = False  # elastic, not gang: gated once, on min_workers
        self.ps_addresses: list[str] = [""] * num_ps
        self.ps_ready = threading.Event()
        # Workers learn the shards' addresses only once every shard is up and, for a resumed job,
        # restored (see open_shards): workers start beside the shards, not after them.
        self.shards_open = num_ps == 0
        self.finished = threading.Event()  # training over (done or failed)
        self.stop_all = threading.Event()  # the master no longer needs any instance (PS included)
        self.duplicates_suppressed = 0
        self.pace = Pace()  # figures, fed as commits happen: throughput, loss, recovery, samples
        # The checkpoint barrier: while `holding`, no lease is handed out, every report's answer asks
        # its worker to hold, and the workers that finished their pushes wait in `hold`.
        self.holding = False
        self.cut_versions: list[int] = []  # each shard's version at the last cut, for the held workers
        self.held: set[str] = set()
        # A lost PS: every shard and the ledger go back to the last checkpoint, as a new generation of
        # the shards' state. While `rewinding`, no lease is handed out and no report commits.
        self.rewinding = False
        self.ps_generation = 0
        self._released = threading.Condition(self.lock)
        self.rendezvous = (
            Rendezvous(
                min_workers,
                ring_max_workers,
                lock=self.lock,
                commit_fn=self._commit_step,
                record=self.timeline.record,
                state_lost_fn=lambda: self._state_lost(members_lost),
            )
            if ring_max_workers is not None
            else None
        )

    def _state_lost(self, members_lost: Callable[[], bool]) -> None:
        """allreduce: the last member is gone, and the only copy of the weights with it (lock held).
        The ledger and the newcomers go back to the last checkpoint (`members_lost`, the job's checkpoints);
        without one, the ledger goes back to the start. Either way the final model still holds every record
        exactly once."""
        if members_lost():
            return
        again = self.ledger.rewind()
        if again:
            log.warning(
                "every allreduce member was lost, and the trained weights with them: no checkpoint "
                "to restore, so training starts over; %d committed records will be trained again",
                again,
            )
            self.timeline.record("rewound", "", f"every member lost: {again} committed records to train again")

    def _commit_step(self, ready: dict, now: float) -> bool:
        """An allreduce step commits (lock held): every member's watermark at once. True when done."""
        epoch_before = self.ledger.epoch
        records = sum(r.records for r in ready.values())
        # Each step a sample, as when every step committed alone: a lease's first step (it reads and feeds the lease)
        # is one of many, not a share of every run that holds one.
        for i in range(max(r.steps for r in ready.values())):
            self.ring_paces.committed(
                {w: (_nth(r.step_compute_s, i, r.compute_s / r.steps), r.records / r.steps) for w, r in ready.items()}
            )
        for worker, r in ready.items():
            self.membership.seen(InstanceId.parse(worker), progressed=True)
            if r.records or self.hangs.idle(worker) is not None:
                # A member's clock starts at its first step with records: one before (no lease yet) traced nothing.
                self.hangs.committed(worker)
            self.pace.replacement_committed(worker, now)
            if r.task_id < 0:
                continue
            try:
                self.ledger.report(worker, r.task_id, r.watermark)
            except LedgerError as e:
                log.warning("refused a step commit: %s", e)
                self.timeline.record("refused", worker, str(e))
        if records:
            self._committed(now, sum(r.loss * r.records for r in ready.values()) / records, epoch_before)
        return self.ledger.done

    def throughput(self) -> float:
        """The steady state's records a second (lock held): see Pace.throughput."""
        return self.pace.throughput(self.ledger.records_committed_total())

    def epoch_evaluated(self, epoch: int, last: bool) -> None:
        """Early stopping: the epoch `epoch`, held at its end, was evaluated; the next may be leased, unless `last`
        (training ends with it)."""
        with self.lock:
            epoch_before = self.ledger.epoch
            self.ledger.epoch_evaluated(epoch, last)
            self._epoch_ended(epoch_before)

    def _committed(self, now: float, loss: float, epoch_before: int) -> None:
        """After records committed (lock held): the pace's figures, an epoch's end, the end of the job."""
        self.pace.committed(now, loss, self.ledger.records_committed_total())
        self._epoch_ended(epoch_before)

    def _epoch_ended(self, epoch_before: int) -> None:
        """An epoch's end, if the ledger went past `epoch_before`, and the end of the job (lock held)."""
        if self.ledger.epoch != epoch_before:
            self.timeline.record(
                "epoch_end",
                "",
                f"epoch {epoch_before} committed {self.ledger.accounts[epoch_before].committed} records",
            )
            account = self.ledger.accounts[epoch_before].as_dict()
            log.info("epoch %d complete: %s", epoch_before, account, extra={"event": "epoch_end"})
        if self.ledger.done:
            self.finished.set()

    def allreduce_peer_failed(self, reporter: str, version: int, peer: str, detail: str) -> None:
        """A member could not reach a peer: the peer leaves the ring, its lease remainder is requeued."""
        with self.lock:
            if self.rendezvous is None or not self.rendezvous.peer_failed_locked(reporter, version, peer, detail):
                return
            self._release(peer, f"unreachable from {reporter}", time.time())

    # ------------------------------------------------------------ RPC side
    def register(self, inst: InstanceId, address: str, device: str = "") -> list[str]:
        """An instance registers (a worker again and again while it waits for the shards), a worker saying what it
        trains on (`device`). Returns the shards' addresses, or empty ones while a worker may not push to them yet."""
        with self.lock:
            if self.membership.registered(inst, address, device):
                self.timeline.record("registered", str(inst), address, **({"device": device} if device else {}))
                log.info(
                    "%s registered%s%s",
                    inst,
                    f" at {address}" if address else "",
                    f", trains on {device}" * bool(device),
                )
            if inst.role == "ps":
                self.ps_addresses[inst.index] = address
                if all(self.ps_addresses):
                    self.ps_ready.set()
            if self.rendezvous is not None and inst.role == "worker":
                self.rendezvous.join_locked(str(inst), address)
            # Not before every shard is up (and restored), nor while they are restored after a loss.
            if not self.shards_open or self.rewinding:
                return [""] * len(self.ps_addresses)
            return list(self.ps_addresses)

    def shard_addresses(self) -> list[str]:
        """Where each PS shard listens now (empty: not registered, or lost)."""
        with self.lock:
            return list(self.ps_addresses)

    def open_shards(self) -> None:
        """Every shard is up (and a resumed job's restored): workers may learn where they are."""
        with self.lock:
            self.shards_open = True

    # ------------------------------------------------------------ the checkpoint barrier
    def begin_hold(self) -> None:
        with self.lock:
            if self.rendezvous is not None:
                # allreduce: no step commits, so every member's weights stay those of the last one.
                self.rendezvous.hold_commits = True
                return
            self.holding = True
            self.held.clear()
            self.cut_versions = []

    def cut_taken(self, shard_versions: list[int]) -> None:
        """PS: the shards' versions at the cut being taken; the held workers learn them at their release."""
        with self.lock:
            self.cut_versions = list(shard_versions)

    def hold_reached(self) -> bool:
        """PS: every worker holding a lease has finished and reported its pushes, and waits: nothing
        is in flight, so the shards' state and the ledger are at one cut. allreduce: at once (a
        step's records and its update commit together)."""
        with self.lock:
            if self.rendezvous is not None:
                return self.rendezvous.hold_commits
            return self.holding and all(w in self.held for w in self.ledger.leases)

    def end_hold(self) -> None:
        with self.lock:
            if self.rendezvous is not None:
                self.rendezvous.release_commits()
            self.holding = False
            self.held.clear()
            self._released.notify_all()

    def state_to_cut(self) -> bool:
        """Whether a checkpoint can be cut now. PS: a full set of shards, not being restored. allreduce:
        members holding a committed step of their own (not still loading a resumed checkpoint)."""
        with self.lock:
            rdv = self.rendezvous
            if rdv is None:
                return not self.rewinding and self.ps_ready.is_set()
            return bool(rdv.members) and rdv.committed_step > 0 and not rdv.restore_checkpoint and not rdv.done

    def waiting_for_hold(self) -> list[str]:
        """The workers a checkpoint's barrier still waits for (for a log line)."""
        with self.lock:
            return [] if self.rendezvous is not None else sorted(set(self.ledger.leases) - self.held)

    def hold(self, inst: InstanceId, wait_s: float) -> list[int] | None:
        """A worker with nothing in flight waits for the checkpoint to be cut. None while it is held; once
        released, each shard's version at the cut (empty when not known)."""
        with self.lock:
            if self.holding:
                self.held.add(str(inst))
                self._released.wait_for(lambda: not self.holding, timeout=wait_s)
            return None if self.holding else list(self.cut_versions)

    def get_task(self, inst: InstanceId, after: int | None = None) -> Lease | None | str:
        """A lease (with `after`, the one to start after that task: see Ledger.lease), None
        (wait), or "done"."""
        with self.lock:
            member = self.membership.members.get(inst)
            if self.finished.is_set() or self.ledger.done or (member is not None and member.state == "gone"):
                # A worker the backend declared gone (e.g. a pod in its grace period) gets no new
                # lease: one it held was already requeued, and nobody would release another.
                return "done"
            if self.rewinding or (self.holding and not self.ledger.held(str(inst))):
                return None  # no new work while a checkpoint is cut; leases held are handed out again
            self.membership.seen(inst)
            if not self.training_started:
                if self.membership.training_count() < self.min_workers:
                    return None
                self.training_started = True
                self.timeline.record(
                    "training_started",
                    "",
                    f"{self.membership.training_count()} workers registered (min {self.min_workers})",
                )
                log.info(
                    "training starts: %d worker(s) registered, min_workers=%d",
                    self.membership.training_count(),
                    self.min_workers,
                )
            worker = str(inst)
            had = self.ledger.held(worker)
            lease = self.ledger.lease(worker, time.time(), after=after)
            if lease is None and after is None and not had and self.rendezvous is None and not self.holding:
                lease = self._take_from_straggler(worker, time.time())
            if lease is not None and lease not in had and lease.start != lease.task.start:
                # Only re-leases make the timeline: a lost worker's remainder finding a new home.
                self.timeline.record(
                    "re-leased",
                    worker,
                    f"task {lease.task.task_id} records [{lease.start},{lease.task.end}) epoch {lease.task.epoch}",
                )
            return lease

    def _take_from_straggler(self, idle: str, now: float) -> Lease | None:
        """ps, lock held: `idle` asks for work and the queue is empty; it takes a straggler's, if one holds some."""
        handover = self.stragglers.pick(idle, self.ledger, now)
        if handover is None:
            return None
        lease = self.ledger.hand_over(handover.holder, idle, now, cut=handover.cut)
        self.timeline.record("straggler", handover.holder, str(handover), t=now, **handover.figures())
        log.warning("%s is a straggler: %s", handover.holder, handover)
        return lease

    def report_progress(self, inst: InstanceId, task_id: int, watermark: int, loss: float, duplicate: bool) -> bool:
        """Commit a minibatch. Returns False when the report is refused (the worker must stop)."""
        now = time.time()
        with self.lock:
            worker = str(inst)
            epoch_before = self.ledger.epoch
            if self.rewinding:  # the ledger went back to a checkpoint: this lease is gone
                return False
            over = None
            try:
                fresh = self.ledger.report(worker, task_id, watermark)
            except LeaseOver as e:  # a straggler's tail went to another worker: what is below the cut is committed
                over, fresh = e, 0
            except LedgerError as e:
                log.warning("refused a progress report: %s", e)
                self.timeline.record("refused", worker, str(e))
                return False
            self.membership.seen(inst, progressed=True)
            self.hangs.committed(worker)
            self.stragglers.reported(worker, task_id, fresh, now)
            self.pace.replacement_committed(worker, now)
            if duplicate:
                self.duplicates_suppressed += 1
            self._committed(now, loss, epoch_before)
            if over is not None:
                log.info("%s: lease over: %s", worker, over)
                self.timeline.record("lease_over", worker, str(over))
            return over is None

    # ------------------------------------------------------------ backend side
    def on_instance_event(self, ev: InstanceEvent) -> tuple[int, int] | None:
        """Apply a backend event; a lost worker's remainder is requeued at once. Returns it."""
        with self.lock:
            self.membership.on_event(ev)
            detail = ev.detail or ("" if ev.exit_code is None else f"exit code {ev.exit_code}")
            self.timeline.record(ev.kind.value, str(ev.instance), detail, t=ev.time)
            if ev.kind not in (EventKind.EXITED, EventKind.LOST) or ev.instance.role != "worker":
                return None
            remainder = self._release(str(ev.instance), detail or ev.kind.value, ev.time)
            if remainder is not None:
                log.info(
                    "%s gone (%s): requeued its remainder [%d, %d) at once",
                    ev.instance,
                    detail or ev.kind.value,
                    *remainder,
                    extra={"event": ev.kind.value},
                )
            return remainder

    def _release(self, worker: str, why: str, t: float) -> tuple[int, int] | None:
        """A worker is gone, or as good as gone (lock held): it leaves the ring, its leases' remainders are
        requeued from their watermarks, and its clock stops. Returns its current lease's remainder."""
        self.hangs.forget(worker)
        self.stragglers.forget(worker)
        self.ring_paces.forget(worker)
        if self.rendezvous is not None:
            self.rendezvous.remove_locked(worker, why, at=t)
        ahead = self.ledger.ahead.get(worker)
        remainder = self.ledger.release(worker, t)
        if remainder is not None:
            self.timeline.record("requeued", worker, f"records [{remainder[0]},{remainder[1]})", t=t)
        if ahead is not None:
            self.timeline.record("requeued", worker, f"lease ahead, records [{ahead.watermark},{ahead.task.end})", t=t)
        return remainder

    # ------------------------------------------------------------ fencing (master/gray/fence.py)
    def fence(self, inst: InstanceId, why: str) -> int:
        """The master gives `inst`'s current launch up: fence it (before its lease is requeued). Returns the launch
        fenced, 0 when there was none to fence (already fenced, or not a worker)."""
        with self.lock:
            member = self.membership.members.get(inst)
            if inst.role != "worker" or member is None or not self.fences.fence(str(inst), member.launches, why):
                return 0
            self.timeline.record("fenced", str(inst), f"launch {member.launches}: {why}", launch=member.launches)
            log.info(
                "%s launch %d fenced (%s): its calls and pushes are refused",
                inst,
                member.launches,
                why,
                extra={"event": "fenced"},
            )
            return member.launches

    def fenced_call(self, inst: InstanceId, launch: int, call: str) -> str | None:
        """Why a call of `inst`'s launch `launch` is refused, or None. Its first refusal makes the timeline."""
        member = self.membership.members.get(inst)
        if launch <= 0 or (str(inst) not in self.fences.fenced and (member is None or launch <= member.launches)):
            # Every call asks: the usual answer without the lock. A fence that lands meanwhile is one the call came
            # before, and the ledger refuses what it reports once the lease is requeued.
            return None
        with self.lock:
            refusal = self.fences.refusal(str(inst), launch)
            if refusal is not None and self.fences.fenced[str(inst)].refused == 1:
                self.timeline.record("fence_refused", str(inst), f"launch {launch}: {call} refused", launch=launch)
                log.warning("%s launch %d called %s: refused, %s", inst, launch, call, refusal)
            member = self.membership.members.get(inst)
            if refusal is None and member is not None and launch > member.launches:
                # An instance a previous master launched, adopted by this one (a pod kept as it was): its number
                # is the one to fence, and its successor's comes after it.
                member.launches = launch
            return refusal

    # ------------------------------------------------------------ hangs
    def heard_from(self, inst: InstanceId) -> None:
        """Any call of the instance's: it is not frozen (allreduce: see `hung_workers`)."""
        with self.lock:
            self.membership.seen(inst)

    def hung_workers(self, now: float, paused: bool = False) -> list[Hung]:
        """Advance the workers' hang clocks; the workers past their bound (master/gray/hang.py). A clock runs while
        its worker holds work the job waits on and may progress: a lease, and not waiting in a checkpoint's
        barrier (ps); a place in the ring, while steps may commit (allreduce). `paused`: the job holds every
        worker (an epoch's evaluation)."""
        with self.lock:
            rdv = self.rendezvous
            if paused or self.rewinding or self.finished.is_set():
                running: set[str] = set()
            elif rdv is None:
                running = set(self.ledger.leases) - (self.held if self.holding else set())
            elif rdv.hold_commits or rdv.restore_checkpoint:
                running = set()
            else:
                running = {name for name, _ in rdv.members}
            late = self.hangs.tick(now, running)
            if rdv is not None:
                # A ring stalls as a whole when one member does, and the members waiting on it keep asking the
                # master whether the ring changed (every ~50 ms): the one that says nothing is the one stuck.
                late = [h for h in late if now - self._last_heard(h.worker) > h.bound_s]
            return late

    def _last_heard(self, worker: str) -> float:
        member = self.membership.members.get(InstanceId.parse(worker))
        return member.last_seen if member is not None else 0.0

    def declare_hung(self, hung: Hung, now: float) -> tuple[int, int] | None:
        """`hung` is as good as gone (its instance is being stopped): it gets no new lease, and its remainder
        is requeued from its watermark at once, as for a kill. Returns the remainder."""
        with self.lock:
            self.membership.declared_gone(InstanceId.parse(hung.worker), now)
            figures = {"idle_s": round(hung.idle_s, 1), "bound_s": round(hung.bound_s, 1)}
            self.timeline.record("hung", hung.worker, f"{hung}: declared hung, stopped and replaced", t=now, **figures)
            remainder = self._release(hung.worker, f"declared hung, {hung}", now)
        what = f"lease requeued, records [{remainder[0]}, {remainder[1]})" if remainder else "it held no lease"
        log.warning("%s: %s: declared hung, %s", hung.worker, hung, what, extra={"event": "hung"})
        return remainder

    def ring_straggler(self, paused: bool = False) -> Straggler | None:
        """allreduce: the member to leave out of the ring as a straggler, if any (master/gray/ring_straggler.py). None
        while the ring does not train at its own pace: `paused` (an epoch's evaluation), a checkpoint's hold, a
        restore."""
        with self.lock:
            rdv = self.rendezvous
            self.ring_paces.quiet = paused
            if rdv is None or paused or self.rewinding or self.finished.is_set() or rdv.done:
                return None
            if rdv.hold_commits or rdv.restore_checkpoint:
                return None
            return self.ring_paces.pick([name for name, _ in rdv.members], self.min_workers)

    def declare_straggler(self, straggler: Straggler, now: float) -> tuple[int, int] | None:
        """`straggler` leaves the ring (its instance is being stopped), as a hung member does: it gets no new
        lease and its remainder is requeued from its watermark at once. Returns the remainder."""
        worker = straggler.worker
        with self.lock:
            self.membership.declared_gone(InstanceId.parse(worker), now)
            if straggler.again:
                self.retired.add(worker)
            self.timeline.record("straggler", worker, str(straggler), t=now, **straggler.figures())
            remainder = self._release(worker, f"a straggler, {straggler.action}", now)
        log.warning("%s is a straggler: %s", worker, straggler, extra={"event": "straggler"})
        return remainder

    def mark_replacement(self, inst: InstanceId, lost_at: float) -> None:
        """A replacement of `inst` was launched; its first commit closes the recovery figure."""
        with self.lock:
            self.pace.replaced(str(inst), lost_at)

    def worker_spent(self, inst: InstanceId, launch: int, step_s: float, wait_s: float) -> None:
        """A worker's own figures (Pace.worker_spent), as its report or its run's StepReady carries them."""
        with self.lock:
            self.pace.worker_spent(str(inst), launch, step_s, wait_s)

    def shard_pushes(self, inst: InstanceId, applied: int, skipped: int) -> None:
        """A PS shard's pushes so far, as its heartbeat says them (Pace.shard_pushes)."""
        with self.lock:
            self.pace.shard_pushes[inst.index] = (applied, skipped)

    def worker_counts(self) -> tuple[int, int]:
        """(workers launched and not gone, workers training)."""
        with self.lock:
            states = self.membership.worker_states()
            return sum(states.values()) - states["gone"], states["registered"]

    def count_worker_loss(self, cause: str) -> None:
        with self.lock:
            self.membership.lost_one(cause)

    def sample(self, records_per_s: float) -> dict:
        """Progress now (Pace.sample)."""
        with self.lock:
            fields = {
                "epoch": min(self.ledger.epoch, self.ledger.epochs - 1),
                "records": self.ledger.records_committed_total(),
                "records_per_s": round(records_per_s, 1),
            }
            alive = self.membership.alive_samples
            return self.pace.sample(time.time() - self.timeline.t0, fields, alive, len(self.membership.training()))


def _nth(values: tuple[float, ...], i: int, otherwise: float) -> float:
    return values[i] if i < len(values) else otherwise
