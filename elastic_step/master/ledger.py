"""The task ledger: which records of which epoch are leased, committed, or waiting.

A task is a record range `[start, end)` of one shard. A worker holds a *lease* (a task, or the
remainder of one) and reports a *watermark* after each minibatch it pushed; the records below the
watermark are committed. It may also hold one lease *ahead*, taken while it trains the current one
so that it reads it in advance and goes on without a pause; that becomes its current lease when the
current one's last report arrives (reports come in order). When a worker is lost, only the
remainders `[watermark, end)` go back to the front of the queue. Epochs never overlap: epoch e+1 is
cut only when every record of epoch e is committed.

A straggler's work may be *handed over* to an idle worker (see master/straggler.py for when): its lease ahead
whole, or the tail `[cut, end)` of its current lease, which then ends at `cut`. The tail keeps the task's id and
its minibatch boundaries (the cut is on one), so whichever of the two pushes a minibatch first, the shards apply
it once (its push key is the same); the ledger commits the tail from its new holder only, and the straggler's
reports past the cut are refused with `LeaseOver`: it stops and asks for new work.

The ledger is plain data and deterministic (no clock, no threads): callers pass `now`,
the service wraps it in a lock, and a property-based test drives it directly.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import Iterable

from elastic_step.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    uri: str
    rows: int


@dataclasses.dataclass(frozen=True)
class TaskDef:
    task_id: int
    epoch: int
    shard: str
    start: int
    end: int


@dataclasses.dataclass
class Lease:
    task: TaskDef
    start: int  # first record of this lease
    watermark: int  # records below this are committed
    worker: str
    leased_at: float

    @property
    def remainder(self) -> tuple[int, int]:
        return self.watermark, self.task.end


@dataclasses.dataclass
class EpochAccount:
    epoch: int
    records: int
    committed: int = 0
    double_applied: int = 0
    requeued: int = 0  # records put back in the queue by losses

    @property
    def lost(self) -> int:
        return self.records - self.committed

    def as_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "records": self.records,
            "committed": self.committed,
            "lost": self.lost,
            "double_applied": self.double_applied,
            "requeued": self.requeued,
        }


class LedgerError(Exception):
    """A report that contradicts the ledger (wrong worker, unknown task, watermark out of range)."""


class LeaseOver(LedgerError):
    """A report of work that was handed over to another worker (see `Ledger.hand_over`): the lease is over."""


class Ledger:
    def __init__(
        self, shards: Iterable[ShardInfo], records_per_task: int, epochs: int, minibatch_size: int = 1, seed: int = 0
    ):
        shards = list(shards)
        # A shard's position in the manifest names its records in pushes (see PushKey).
        self.shard_index = {s.uri: i for i, s in enumerate(shards)}
        self.shards = [s for s in shards if s.rows > 0]
        if not self.shards:
            raise ConfigError("The training data has no records: check the train manifest.")
        if records_per_task < 1 or epochs < 1 or minibatch_size < 1:
            raise ConfigError("records_per_task, epochs and minibatch_size must all be >= 1.")
        # Tasks hold whole minibatches, so minibatch boundaries (the PS idempotency keys) are the
        # same whoever processes a task and wherever it was interrupted.
        self.records_per_task = max(minibatch_size, records_per_task // minibatch_size * minibatch_size)
        self.epochs = epochs
        self.minibatch_size = minibatch_size
        self.seed = seed
        self.records_per_epoch = sum(s.rows for s in self.shards)
        self.epoch = -1
        self.accounts: list[EpochAccount] = []
        self.queue: collections.deque[tuple[TaskDef, int]] = collections.deque()  # (task, start)
        self.leases: dict[str, Lease] = {}  # worker -> its current lease
        self.ahead: dict[str, Lease] = {}  # worker -> the lease it starts next
        self.committed: dict[int, list[list[int]]] = {}  # task_id -> merged committed intervals
        self.tasks: dict[int, TaskDef] = {}
        self._next_id = 0
        self._lost_at: dict[int, float] = {}  # task_id -> when its remainder was requeued
        self.requeue_latencies: list[float] = []
        self.trained_again = 0  # records committed, then rewound (see rewind)
        self._handed_over: set[tuple[str, int]] = set()  # (worker, task_id) whose work went to another worker
        self._advance_epoch()

    # ------------------------------------------------------------------ state
    @property
    def done(self) -> bool:
        return self.epoch >= self.epochs

    @property
    def account(self) -> EpochAccount:
        return self.accounts[self.epoch]

    def records_committed_total(self) -> int:
        return sum(a.committed for a in self.accounts)

    # ------------------------------------------------------------------ transitions
    def lease(self, worker: str, now: float, after: int | None = None) -> Lease | None:
        """The worker's current lease, or a new one from the queue; None when nothing is leasable.

        With `after` (the task the worker is starting), the lease to start after that one: its lease
        ahead (the same one again until it becomes current), or, holding no lease at all, a current
        one. None while its current lease is an earlier one: its last reports are still on their
        way, and a worker holds one lease ahead at most."""
        held = self.leases
        if after is not None and worker in self.leases:
            if self.leases[worker].task.task_id != after:
                return None
            held = self.ahead
        if worker in held:
            return held[worker]
        if self.done or not self.queue:
            return None
        task, start = self.queue.popleft()
        lease = Lease(task=task, start=start, watermark=start, worker=worker, leased_at=now)
        held[worker] = lease
        lost_at = self._lost_at.pop(task.task_id, None)
        if lost_at is not None:
            self.requeue_latencies.append(max(0.0, now - lost_at))
        return lease

    def report(self, worker: str, task_id: int, watermark: int) -> int:
        """Commit the worker's records up to `watermark`; returns how many were newly committed."""
        lease = self.leases.get(worker)
        over = (worker, task_id) in self._handed_over
        if over and lease is not None and lease.task.task_id == task_id and watermark > lease.task.end:
            # It trained on past the cut before it knew: what is below the cut is its, the rest another's.
            self.report(worker, task_id, lease.task.end)
            lease = None
        if lease is None or lease.task.task_id != task_id:
            if over:
                raise LeaseOver(f"{worker} reported task {task_id} past the cut: its tail was handed over")
            raise LedgerError(f"{worker} reported task {task_id} it does not hold")
        if not lease.watermark <= watermark <= lease.task.end:
            raise LedgerError(
                f"{worker} reported watermark {watermark} outside "
                f"[{lease.watermark}, {lease.task.end}] of task {task_id}"
            )
        if watermark != lease.task.end and (watermark - lease.task.start) % self.minibatch_size:
            # Watermarks sit on minibatch boundaries: they are the PS idempotency keys' seqs.
            raise LedgerError(f"{worker} reported watermark {watermark} off the minibatch boundaries of task {task_id}")
        fresh = self._commit(lease.task, lease.watermark, watermark)
        lease.watermark = watermark
        if watermark == lease.task.end:
            del self.leases[worker]
            if worker in self.ahead:
                self.leases[worker] = self.ahead.pop(worker)
            self._maybe_finish_epoch()
        return fresh

    def hand_over(self, holder: str, to: str, now: float, cut: int | None = None) -> Lease:
        """Give part of a straggler's work to `to`, a worker that holds no lease: without `cut`, the straggler's
        lease ahead, whole; with it, the tail `[cut, end)` of its current lease, `cut` on a minibatch boundary
        above its watermark. Returns `to`'s new lease (see the module's docstring for why it is safe)."""
        if to in self.leases or to in self.ahead:
            raise LedgerError(f"{to} holds a lease: it takes no other worker's")
        if cut is None:
            lease = self.ahead.pop(holder)
            lease.worker, lease.leased_at = to, now
        else:
            current = self.leases[holder]
            task = current.task
            if not current.watermark < cut < task.end or (cut - task.start) % self.minibatch_size:
                raise LedgerError(f"cut {cut} is not a minibatch boundary inside [{current.watermark}, {task.end})")
            lease = Lease(task=task, start=cut, watermark=cut, worker=to, leased_at=now)
            current.task = dataclasses.replace(task, end=cut)
        self._handed_over.add((holder, lease.task.task_id))
        self.leases[to] = lease
        return lease

    def held(self, worker: str) -> list[Lease]:
        """The worker's leases: current first, then the one ahead."""
        return [d[worker] for d in (self.leases, self.ahead) if worker in d]

    def release(self, worker: str, now: float) -> tuple[int, int] | None:
        """The worker is gone: put its remainders back at the front of the queue, at once, the
        current lease's first. Returns the current lease's remainder (the work it was doing; its
        requeue latency is the one measured)."""
        lease, ahead = self.leases.pop(worker, None), self.ahead.pop(worker, None)
        if ahead is not None:
            self.queue.appendleft((ahead.task, ahead.watermark))
            self.account.requeued += ahead.task.end - ahead.watermark
        if lease is None:
            return None
        lo, hi = lease.remainder
        if lo < hi:
            self.queue.appendleft((lease.task, lo))
            self.account.requeued += hi - lo
            self._lost_at[lease.task.task_id] = now
            return lo, hi
        self._maybe_finish_epoch()
        return None

    def rewind(self) -> int:
        """The trained state that every commit went into is gone, and no checkpoint holds any part of
        it: what was committed is no longer in any model, so it becomes uncommitted and training
        starts over from the first epoch. Returns how many records will be trained again. Leases are
        dropped (their holders' next reports are refused); task ids keep counting, so no push key of
        before is ever reused."""
        again = self.records_committed_total()
        self.trained_again += again
        self.epoch = -1
        self.accounts.clear()
        self.queue.clear()
        self.leases.clear()
        self.ahead.clear()
        self.committed.clear()
        self._lost_at.clear()
        self._handed_over.clear()
        self._advance_epoch()
        return again

    # ------------------------------------------------------------------ checkpoints
    def cut(self) -> dict:
        """The ledger as plain data, for a checkpoint. Leases are not carried over: a restored ledger
        puts their remainders (and leases ahead) back at the front of the queue, where whoever holds
        the job next takes them, under the same task ids and minibatch boundaries as before."""
        held = [(lease.task, lease.watermark) for lease in [*self.leases.values(), *self.ahead.values()]]
        queue = [
            # A task cut short by a hand-over (see hand_over) carries its own end.
            [task.task_id, start] + ([task.end] if task.end != self.tasks[task.task_id].end else [])
            for task, start in [*held, *self.queue]
            if start < task.end
        ]
        live = {t for t, *_ in queue} | {t for t, task in self.tasks.items() if task.epoch == self.epoch}
        return {
            "epoch": self.epoch,
            "next_id": self._next_id,
            "trained_again": self.trained_again,
            "shards": [[s.uri, s.rows] for s in self.shards],
            "accounts": [dataclasses.asdict(a) for a in self.accounts],
            "tasks": {
                str(t): [task.epoch, task.shard, task.start, task.end] for t, task in self.tasks.items() if t in live
            },
            "committed": {str(t): [list(i) for i in iv] for t, iv in self.committed.items() if t in live},
            "queue": queue,
        }

    def restore(self, cut: dict) -> int:
        """Go back to a cut (see `cut`); returns how many records committed now were not then (they
        will be trained again)."""
        if [[s.uri, s.rows] for s in self.shards] != cut["shards"]:
            raise ConfigError("the checkpoint's ledger is over other data shards than this job's")
        again = max(0, self.records_committed_total() - sum(a["committed"] for a in cut["accounts"]))
        self.epoch, self._next_id = cut["epoch"], cut["next_id"]
        self.trained_again = cut["trained_again"] + again
        self.accounts = [EpochAccount(**a) for a in cut["accounts"]]
        self.tasks = {int(t): TaskDef(int(t), e, uri, lo, hi) for t, (e, uri, lo, hi) in cut["tasks"].items()}
        self.committed = {int(t): [list(iv) for iv in ivs] for t, ivs in cut["committed"].items()}
        self.queue = collections.deque(
            (dataclasses.replace(self.tasks[t], end=end[0]) if end else self.tasks[t], start)
            for t, start, *end in cut["queue"]
        )
        self.leases.clear()
        self.ahead.clear()
        self._lost_at.clear()
        self._handed_over.clear()
        return again

    # ------------------------------------------------------------------ internals
    def _commit(self, task: TaskDef, lo: int, hi: int) -> int:
        if hi <= lo:
            return 0
        intervals = self.committed.setdefault(task.task_id, [])
        overlap = sum(max(0, min(hi, e) - max(lo, s)) for s, e in intervals)
        intervals.append([lo, hi])
        intervals.sort()
        merged: list[list[int]] = []
        for s, e in intervals:
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        self.committed[task.task_id] = merged
        acct = self.accounts[task.epoch]
        acct.double_applied += overlap
        acct.committed += (hi - lo) - overlap
        return (hi - lo) - overlap

    def _maybe_finish_epoch(self) -> None:
        if not self.done and not self.queue and not self.leases and self.account.committed >= self.account.records:
            self._advance_epoch()

    def _advance_epoch(self) -> None:
        self.epoch += 1
        self._handed_over.clear()  # a straggler's reports of a past epoch are refused as any stale ones
        if self.done:
            return
        self.accounts.append(EpochAccount(epoch=self.epoch, records=self.records_per_epoch))
        tasks = []
        for shard in self.shards:
            for start in range(0, shard.rows, self.records_per_task):
                tasks.append((shard.uri, start, min(shard.rows, start + self.records_per_task)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(tasks)  # a new order per epoch
        for uri, start, end in tasks:
            task = TaskDef(self._next_id, self.epoch, uri, start, end)
            self._next_id += 1
            self.tasks[task.task_id] = task
            self.queue.append((task, start))

    def summary(self) -> dict:
        return {
            "records_per_epoch": self.records_per_epoch,
            "records_per_task": self.records_per_task,
            "epochs": [a.as_dict() for a in self.accounts],
        }
