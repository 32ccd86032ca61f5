"""Rendezvous of `--strategy allreduce`: a versioned membership and atomic step commits.

Membership. Workers register with the address of their Collective server. Training starts when
`min_workers` are in: version 1, ranks in registration order. A newcomer is *pending* until the
next step commit, where the version bumps with it appended (rank order otherwise kept, so rank 0
is the longest-standing member: the one newcomers pull weights and optimizer state from). A lost
member (backend LOST/EXITED event, or a peer's `ReportPeerFailure`) bumps the version at once
and aborts the step in progress.

Step protocol. Each member of version v computes its minibatch(es), ring-allreduces the sum of
gradients and record counts and applies the average, step after step: a run of steps, which ends
where any member asked for it in the allreduced buffer (its lease ran out, or the run is long
enough), so every member ends it at the same step. Then each calls `step_ready(v, step, task,
watermark, checksum)` with the run's last step. The run commits only once every member of v is
ready for it: at that moment, under the coordinator's lock, every member's watermark is committed
in the ledger (the data commit of a run is atomic) and every waiting member is told COMMIT. If v
changed meanwhile the answer is ABORT with the new membership: the members go back to the state
they kept at the run's start and train its minibatches again in the new ring. Until COMMIT, a
member serves the kept state to peers and checkpoints, so no one sees a partial run; the weights
checksums the members send (taken after the run) must agree, and `checksum_mismatches` counts any
that do not. A member the master is about to kill (`leaving`) holds every run it is ready in until its
loss is seen: a report it sent just before the signal cannot have the others commit its run, so its
lease's remainder is requeued, as a kill promises (faults/chaos.py).

Checkpoints. While `hold_commits` is set, no step commits (members that are ready wait), so every
member's weights stay those of `committed_step` while the master copies them with the ledger's cut.
A resumed job starts at the checkpoint's step (`restore`): until its first commit, every member loads
the checkpoint's state from the master instead of pulling it from rank 0.

The object shares the coordinator's lock (a Condition on it): ledger, membership and steps
change together. `now` is injectable for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("elastic_step.master")

WAIT, COMMIT, ABORT = "wait", "commit", "abort"


@dataclasses.dataclass
class Ready:
    task_id: int
    watermark: int
    records: int
    loss: float
    checksum: int
    compute_s: float = 0.0  # the member's own time for the run's minibatches (master/gray/ring_straggler.py)
    steps: int = 1  # the run's
    step_compute_s: tuple[float, ...] = ()  # its own time for each step's minibatches


@dataclasses.dataclass
class View:
    """What a worker is told about the membership."""

    state: str  # pending | member | evicted | done | waiting
    version: int
    members: list[tuple[str, str]]
    rank: int
    base_step: int
    committed_step: int
    restore_checkpoint: int = 0  # nonzero: the base state is this checkpoint's, loaded from the master


class LoopWake:
    """Wakes what waits for the rendezvous to change on one asyncio event loop (the master's step calls), from
    any thread: the loop's counterpart of the rendezvous's condition, which wakes threads."""

    def __init__(self):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next: asyncio.Future | None = None

    def next_change(self) -> asyncio.Future:
        """On the loop: a future set at the next change. Taken before the state is looked at, so that a change
        after the look sets it."""
        if self._next is None:
            self._loop = asyncio.get_running_loop()
            self._next = self._loop.create_future()
        return self._next

    def ring(self) -> None:
        """From any thread (the rendezvous's lock held): the loop's waiters look again."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the master stopped serving, none waits
                self._loop.call_soon_threadsafe(self._rang)

    def _rang(self) -> None:
        change, self._next = self._next, self._loop.create_future()
        change.set_result(None)


class Rendezvous:
    def __init__(
        self,
        min_workers: int,
        max_workers: int,
        lock: threading.Lock | None = None,
        commit_fn: Callable[[dict[str, Ready], float], bool] | None = None,
        record: Callable[..., None] | None = None,
        now: Callable[[], float] = time.time,
        state_lost_fn: Callable[[], None] | None = None,
    ):
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.cv = threading.Condition(lock or threading.Lock())
        self.commit_fn = commit_fn or (lambda ready, now: False)  # True: training is complete
        self.record = record or (lambda *a, **k: None)
        self.state_lost_fn = state_lost_fn or (lambda: None)  # every member gone: the weights with them
        self.now = now
        self.version = 0
        self.members: list[tuple[str, str]] = []  # (name, address), rank order
        self.pending: list[tuple[str, str]] = []
        self.base_step = 0
        self.committed_step = 0
        self.ready: dict[str, Ready] = {}
        self.ready_step = 0  # the run's last step the ready members are at
        self.hold_commits = False  # a checkpoint is being cut
        self.leaving: set[str] = set()  # members being killed, until their loss is seen: no run commits with them
        self.changes = LoopWake()  # rung (lock held) wherever the condition is notified
        self.restore_checkpoint = 0  # see View.restore_checkpoint
        self.commits: dict[int, tuple[int, frozenset[str]]] = {}  # a run's last step -> (version, members)
        self.done = False
        # figures
        self.steps_committed = 0
        self.runs_committed = 0
        self.aborted_steps = 0
        self.checksum_mismatches = 0
        self.versions: list[dict] = []
        self.loss_to_next_commit_s: list[float] = []
        self.join_to_first_commit_s: list[float] = []
        self._lost_at: list[float] = []  # losses not yet followed by a commit
        self._registered_at: dict[str, float] = {}  # newcomer -> registration time

    # ------------------------------------------------------------------ helpers (lock held)
    def _changed(self) -> None:
        """Steps, membership or the end changed: wake the calls waiting on them (threads on the condition, and
        the master's step calls, on its event loop, through `changes`)."""
        self.cv.notify_all()
        self.changes.ring()

    def _names(self) -> list[str]:
        return [n for n, _ in self.members]

    def _admit_without_state(self) -> None:
        """Every member is gone, and the trained weights with them: the newcomers are admitted now,
        from their own initial state, and what was committed is trained again (state_lost_fn)."""
        self.members, self.pending = self.pending, []
        self.state_lost_fn()

    def _bump(self, why: str, aborts: bool = False) -> None:
        # A loss aborts the step in progress: its members were in its collective or about to be.
        aborts = aborts and self.version > 0 and not self.done
        self.version += 1
        self.base_step = self.committed_step
        if aborts:
            self.aborted_steps += 1
            self.record("step_aborted", "", f"step {self.committed_step + 1} aborted: {why}")
        self.ready.clear()
        self.versions.append(
            {
                "version": self.version,
                "world": len(self.members),
                "base_step": self.base_step,
                "why": why,
                "members": self._names(),
            }
        )
        self.record("membership", "", f"version {self.version}: {', '.join(self._names()) or '(none)'} ({why})")
        log.info("allreduce membership version %d: %s (%s)", self.version, self._names(), why)
        self._changed()

    def view(self, worker: str) -> View:
        names = self._names()
        if self.done:
            state = "done"
        elif worker in names:
            state = "member"
        elif any(n == worker for n, _ in self.pending):
            state = "pending" if self.version else "waiting"
        else:
            state = "evicted"
        return View(
            state,
            self.version,
            list(self.members),
            names.index(worker) if worker in names else -1,
            self.base_step,
            self.committed_step,
            self.restore_checkpoint,
        )

    def restore(self, step: int, checkpoint_id: int) -> None:
        """A resumed job (before any member joined): training goes on from a checkpoint's step, whose
        state every member of the first version loads from the master."""
        with self.cv:
            self.restore_locked(step, checkpoint_id)

    def restore_locked(self, step: int, checkpoint_id: int) -> None:
        self.committed_step = self.base_step = step
        self.restore_checkpoint = checkpoint_id
        self.commits.clear()

    # ------------------------------------------------------------------ membership (lock held by caller
    # when called from the coordinator; the public methods below take it themselves)
    def join_locked(self, worker: str, address: str) -> None:
        self.pending = [(n, a) for n, a in self.pending if n != worker]
        if worker in self._names():
            # A member registering again restarted: the old incarnation is gone.
            self.remove_locked(worker, "re-registered")
        self.pending.append((worker, address))
        self._registered_at[worker] = self.now()
        if self.version == 0 and len(self.pending) >= self.min_workers:
            self.members, self.pending = self.pending, []
            for name in self._names():
                self._registered_at.pop(name, None)  # the initial members are not newcomers
            self._bump(f"training starts with {len(self.members)} workers")
        elif self.version and not self.members:
            self._admit_without_state()
            self._bump("no member left: newcomers admitted, from initial weights")
        self._changed()

    def remove_locked(self, worker: str, why: str, at: float | None = None) -> bool:
        """A member is lost: bump the version at once (aborting the step in progress)."""
        self.leaving.discard(worker)
        self.pending = [(n, a) for n, a in self.pending if n != worker]
        self._registered_at.pop(worker, None)
        if worker not in self._names():
            return False
        self.members = [(n, a) for n, a in self.members if n != worker]
        self._lost_at.append(self.now() if at is None else at)
        if not self.members and self.pending:
            self._admit_without_state()
        self._bump(f"{worker} lost: {why}", aborts=True)
        return True

    def join(self, worker: str, address: str) -> None:
        with self.cv:
            self.join_locked(worker, address)

    def leave(self, worker: str, still: Callable[[], bool] = lambda: True) -> bool:
        """`worker` is about to be killed: until its loss is seen, no run it is ready in commits. Only if `still()`
        holds, asked under the lock runs commit under (so no run commits between the two); whether it did."""
        with self.cv:
            if worker in self._names() and still():
                self.leaving.add(worker)
                return True
            return False

    def lost(self, worker: str, why: str = "lost") -> bool:
        with self.cv:
            return self.remove_locked(worker, why)

    def peer_failed_locked(self, reporter: str, version: int, peer: str, detail: str) -> bool:
        """A member could not reach `peer` in `version`: treat the peer as lost (if still current)."""
        if version != self.version or peer not in self._names() or reporter not in self._names():
            return False
        self.record("peer_failure", peer, f"reported by {reporter}: {detail}")
        return self.remove_locked(peer, f"unreachable from {reporter}")

    def release_commits(self) -> None:
        """The checkpoint is cut (lock held): members waiting in step_ready commit the next step."""
        self.hold_commits = False
        self._changed()

    def finish(self) -> None:
        with self.cv:
            self.done = True
            self._changed()

    # ------------------------------------------------------------------ queries
    def membership(self, worker: str, known_version: int = -1, wait_s: float = 0.0) -> View:
        deadline = time.monotonic() + wait_s
        with self.cv:
            while not self.done and self.version == known_version and (remaining := deadline - time.monotonic()) > 0:
                self.cv.wait(remaining)
            return self.view(worker)

    # ------------------------------------------------------------------ steps
    def step_ready(self, worker: str, version: int, step: int, ready: Ready, wait_s: float = 0.0) -> tuple[str, View]:
        deadline = time.monotonic() + wait_s
        with self.cv:
            while True:
                kind = self._step_state(worker, version, step, ready)
                remaining = deadline - time.monotonic()
                if kind != WAIT or remaining <= 0:
                    return kind, self.view(worker)
                self.cv.wait(remaining)

    def _step_state(self, worker: str, version: int, step: int, ready: Ready) -> str:
        done = self.commits.get(step)
        if done is not None:
            return COMMIT if done[0] == version and worker in done[1] else ABORT
        if version != self.version or worker not in self._names() or self.done:
            return ABORT
        if step <= self.committed_step:
            return ABORT
        if self.ready and self.ready_step != step:
            # Members of one version end a run at the same step, decided from the same allreduced flag.
            self._bump(f"members ended a run at steps {self.ready_step} and {step}", aborts=True)
            return ABORT
        self.ready_step = step
        newly_ready = worker not in self.ready
        self.ready[worker] = ready
        if set(self.ready) == set(self._names()) and not self.hold_commits:
            if not self.leaving:
                self._commit(step)
                return COMMIT
            if newly_ready:  # once a run, not at every poll of its members
                log.info(
                    "run to step %d held: %s is being killed, its loss aborts the run", step, ", ".join(self.leaving)
                )
        return WAIT

    def _commit(self, step: int) -> None:
        now = self.now()
        ready = dict(self.ready)
        sums = {r.checksum for r in ready.values()}
        if len(sums) > 1:
            self.checksum_mismatches += 1
            self.record("checksum_mismatch", "", f"step {step}: {len(sums)} different weight checksums")
            log.error("step %d: members' weights differ before applying it", step)
        if self.commit_fn(ready, now):
            self.done = True
        self.commits[step] = (self.version, frozenset(ready))
        if len(self.commits) > 64:  # a late member's call finds its run's answer among the last runs
            self.commits.pop(next(iter(self.commits)))
        self.steps_committed += step - self.committed_step
        self.runs_committed += 1
        self.committed_step = step
        self.restore_checkpoint = 0  # the members hold the state now: newcomers pull it from rank 0
        self.ready.clear()
        if self._lost_at:
            self.loss_to_next_commit_s.extend(now - t for t in self._lost_at)
            self._lost_at.clear()
        for name in ready:
            t = self._registered_at.pop(name, None)
            if t is not None:
                self.join_to_first_commit_s.append(now - t)
        if self.pending and not self.done:
            names = [n for n, _ in self.pending]
            self.members += self.pending
            self.pending = []
            self._bump(f"{', '.join(names)} admitted at step {step}")
        self._changed()

    def summary(self) -> dict:
        with self.cv:
            return {
                "steps_committed": self.steps_committed,
                "runs_committed": self.runs_committed,
                "aborted_steps": self.aborted_steps,
                "checksum_mismatches": self.checksum_mismatches,
                "versions": list(self.versions),
                "final_version": self.version,
                "final_world": len(self.members),
                "loss_to_next_commit_s": [round(x, 3) for x in self.loss_to_next_commit_s],
                "join_to_first_commit_s": [round(x, 3) for x in self.join_to_first_commit_s],
            }
