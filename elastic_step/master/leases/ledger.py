"""The task ledger: which records of which epoch are leased, committed, or waiting.

A task is a record range `[start, end)` of one shard. A worker holds a *lease* (a task, or the
remainder of one) and reports a *watermark* after each minibatch it pushed; the records below the
watermark are committed. It may also hold one lease *ahead*, taken while it trains the current one
so that it reads it in advance and goes on without a pause; that becomes its current lease when the
current one's last report arrives (reports come in order). When a worker is lost, only the
remainders `[watermark, end)` go back to the front of the queue. Epochs never overlap: epoch e+1 is
cut only when every record of epoch e is committed.

A straggler's work may be *handed over* to an idle worker (see master/gray/straggler.py for when): its lease ahead
whole, or the tail `[cut, end)` of its current lease, which then ends at `cut`. The tail keeps the task's id and
its minibatch boundaries (the cut is on one), so whichever of the two pushes a minibatch first, the shards apply
it once (its push key is the same); the ledger commits the tail from its new holder only, and the straggler's
reports past the cut are refused with `LeaseOver`: it stops and asks for new work.

The ledger is plain data and deterministic (no clock, no threads): callers pass `now`,
the service wraps it in a lock, and a property-based test drives it directly.

It stays small at a billion records (a million tasks an epoch): only the current epoch is kept, as its shuffled
order (one int32 a task, from which a task's shard and range are computed), one byte a task for "wholly
committed", the intervals of the few tasks partly committed, and the queue as the remainders put back by losses in
front of a cursor into that order. A checkpoint's cut holds the same, the arrays compressed.
"""

from __future__ import annotations

import array
import base64
import bisect
import collections
import dataclasses
import zlib
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from elastic_step.errors import ConfigError

CUT_FORMAT = 2  # of `Ledger.cut`: 1 listed every task of the epoch, 2 holds its order and commits as arrays


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


class TaskQueue:
    """The tasks waiting for a worker, in the order they are handed out, as (task, first record) pairs: the
    remainders put back by losses (in front, the latest first), then the epoch's tasks no worker has leased yet,
    in the epoch's shuffled order. Those are a cursor into that order, not one entry each: a million of them cost
    nothing until they are leased."""

    def __init__(self, task_at: Callable[[int], TaskDef]):
        self._task_at = task_at  # a position in the epoch's order -> its task
        self.front: collections.deque[tuple[TaskDef, int]] = collections.deque()
        self.fresh = 0  # the first position not leased yet
        self.size = 0  # the epoch's tasks

    def reset(self, size: int, fresh: int = 0, front: Iterable[tuple[TaskDef, int]] = ()) -> None:
        self.front = collections.deque(front)
        self.fresh, self.size = fresh, size

    def __len__(self) -> int:
        return len(self.front) + self.size - self.fresh

    def __iter__(self) -> Iterator[tuple[TaskDef, int]]:
        yield from list(self.front)
        for pos in range(self.fresh, self.size):
            task = self._task_at(pos)
            yield task, task.start

    def __getitem__(self, i: int) -> tuple[TaskDef, int]:
        n = len(self)
        i = i + n if i < 0 else i
        if not 0 <= i < n:
            raise IndexError("task queue index out of range")
        if i < len(self.front):
            return self.front[i]
        task = self._task_at(self.fresh + i - len(self.front))
        return task, task.start

    def popleft(self) -> tuple[TaskDef, int]:
        if self.front:
            return self.front.popleft()
        if self.fresh >= self.size:
            raise IndexError("pop from an empty task queue")
        task = self._task_at(self.fresh)
        self.fresh += 1
        return task, task.start

    def appendleft(self, item: tuple[TaskDef, int]) -> None:
        self.front.appendleft(item)

    def clear(self) -> None:
        self.front.clear()
        self.fresh = self.size


class LedgerError(Exception):
    """A report that contradicts the ledger (wrong worker, unknown task, watermark out of range)."""


class LeaseOver(LedgerError):
    """A report of work that was handed over to another worker (see `Ledger.hand_over`): the lease is over."""


# A task size of 0 (the default) asks for tasks of this many minibatches: each task costs a worker a round trip
# to the master, a read and a feed(), which a small model's 8 minibatches (the former 512 records) did not hide,
# and a lone worker's compiled call holds at most half a lease.
AUTO_MINIBATCHES_PER_TASK = 32
# ... but no fewer tasks an epoch than this, so that a small data set is still shared among workers.
AUTO_MIN_TASKS_PER_EPOCH = 8


def task_size(records_per_task: int, minibatch_size: int, records_per_epoch: int) -> int:
    """Records per task: whole minibatches, so that minibatch boundaries (the PS idempotency keys) are the same
    whoever processes a task and wherever it was interrupted. 0: sized from the minibatch and the epoch (above),
    from nothing else, so a resumed job cuts the same tasks whatever its number of workers."""
    if records_per_task == 0:
        per_epoch = records_per_epoch // AUTO_MIN_TASKS_PER_EPOCH
        records_per_task = min(AUTO_MINIBATCHES_PER_TASK * minibatch_size, per_epoch)
    return max(minibatch_size, records_per_task // minibatch_size * minibatch_size)


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
        if records_per_task < 0 or epochs < 1 or minibatch_size < 1:
            raise ConfigError("epochs and minibatch_size must be >= 1, and records_per_task >= 0.")
        self.epochs = epochs
        self.minibatch_size = minibatch_size
        self.seed = seed
        self.records_per_epoch = sum(s.rows for s in self.shards)
        self.records_per_task = task_size(records_per_task, minibatch_size, self.records_per_epoch)
        # An epoch's tasks in shard order: shard i's are numbered from _first[i], one per records_per_task.
        self._first = [0]
        for s in self.shards:
            self._first.append(self._first[-1] + -(-s.rows // self.records_per_task))
        self.tasks_per_epoch = self._first[-1]
        if self.tasks_per_epoch >= 2**31:
            raise ConfigError(
                f"{self.tasks_per_epoch} tasks an epoch is more than the ledger holds (2**31): raise records_per_task."
            )
        self.epoch = -1
        self.accounts: list[EpochAccount] = []
        # The current epoch: task `_base + p` is task number `_order[p]` in shard order.
        self._base = 0
        self._order = array.array("i")  # read one by one: an array's items are Python ints at once
        self._order_text: str | None = None  # its encoding in a cut, made once an epoch
        self._complete = bytearray()  # per position: 1 once every record of the task is committed
        self._partial: dict[int, list[list[int]]] = {}  # task_id -> merged committed intervals, if not complete
        self.queue = TaskQueue(self._task_at)
        self.leases: dict[str, Lease] = {}  # worker -> its current lease
        self.ahead: dict[str, Lease] = {}  # worker -> the lease it starts next
        self._next_id = 0
        self._lost_at: dict[int, float] = {}  # task_id -> when its remainder was requeued
        self.requeue_latencies: list[float] = []
        self.trained_again = 0  # records committed, then rewound (see rewind)
        self._handed_over: set[tuple[str, int]] = set()  # (worker, task_id) whose work went to another worker
        # Early stopping: an epoch's end waits for its evaluation (`epoch_evaluated`) before the next is leased, so
        # that training can end with it, exactly. `evaluated`: the last epoch evaluated.
        self.hold_epochs = False
        self.evaluated = -1
        self._advance_epoch()

    # ------------------------------------------------------------------ state
    @property
    def done(self) -> bool:
        return self.epoch >= self.epochs

    @property
    def awaiting_evaluation(self) -> bool:
        """The current epoch is committed whole and waits for its evaluation (early stopping)."""
        return self.hold_epochs and not self.done and self._complete_epoch() and self.evaluated < self.epoch

    def epoch_evaluated(self, epoch: int, last: bool) -> None:
        """Early stopping: epoch `epoch` was evaluated; `last`: training ends with it (the epochs that ran)."""
        self.evaluated = max(self.evaluated, epoch)
        if last:
            self.epochs = min(self.epochs, epoch + 1)
        self._maybe_finish_epoch()

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
        self.leases.clear()
        self.ahead.clear()
        self._lost_at.clear()
        self._advance_epoch()
        return again

    # ------------------------------------------------------------------ checkpoints
    def cut(self) -> dict:
        """The ledger as plain data, for a checkpoint. Leases are not carried over: a restored ledger
        puts their remainders (and leases ahead) back at the front of the queue, where whoever holds
        the job next takes them, under the same task ids and minibatch boundaries as before. The epoch's
        order and which tasks are wholly committed are compressed arrays (a few MB for a million tasks)."""
        held = [(lease.task, lease.watermark) for lease in [*self.leases.values(), *self.ahead.values()]]
        queue = [
            # A task cut short by a hand-over (see hand_over) carries its own end.
            [task.task_id, start] + ([task.end] if task.end != self._range(task.task_id - self._base)[2] else [])
            for task, start in [*held, *self.queue.front]
            if start < task.end
        ]
        if self._order_text is None:
            self._order_text = _encode(np.frombuffer(self._order, np.int32).astype("<i4", copy=False))
        return {
            "format": CUT_FORMAT,
            "epoch": self.epoch,
            "next_id": self._next_id,
            "trained_again": self.trained_again,
            "shards": [[s.uri, s.rows] for s in self.shards],
            "accounts": [dataclasses.asdict(a) for a in self.accounts],
            "first_task": self._base,  # the id of the epoch's first task in its order
            "order": self._order_text,  # per task of the epoch, its number in shard order
            "not_leased_from": self.queue.fresh,  # the tasks from there on in the order are queued whole
            "complete": _encode(np.packbits(np.frombuffer(self._complete, np.uint8))),
            "partial": {str(t): [list(i) for i in iv] for t, iv in self._partial.items()},
            "queue": queue,  # in front of those: the remainders, held leases' first
        }

    def restore(self, cut: dict) -> int:
        """Go back to a cut (see `cut`); returns how many records committed now were not then (they
        will be trained again)."""
        if cut.get("format") != CUT_FORMAT:
            raise ConfigError(
                f"the checkpoint's ledger is of format {cut.get('format', 1)}, which this version no longer reads "
                f"(it reads {CUT_FORMAT}): resume with the version that wrote it, or pass --resume never to start over"
            )
        if [[s.uri, s.rows] for s in self.shards] != cut["shards"]:
            raise ConfigError("the checkpoint's ledger is over other data shards than this job's")
        again = max(0, self.records_committed_total() - sum(a["committed"] for a in cut["accounts"]))
        self.epoch, self._next_id = cut["epoch"], cut["next_id"]
        self.trained_again = cut["trained_again"] + again
        self.accounts = [EpochAccount(**a) for a in cut["accounts"]]
        size = 0 if self.done else self.tasks_per_epoch
        self._base, self._order_text = cut["first_task"], cut["order"]
        self._order = array.array("i", _decode(cut["order"], "<i4", size).astype(np.int32).tobytes())
        self._complete = bytearray(np.unpackbits(_decode(cut["complete"], np.uint8, -(-size // 8)))[:size].tobytes())
        self._partial = {int(t): [list(iv) for iv in ivs] for t, ivs in cut["partial"].items()}
        front = []
        for t, start, *end in cut["queue"]:
            task = self._task_at(t - self._base)
            front.append((dataclasses.replace(task, end=end[0]) if end else task, start))
        self.queue.reset(size, cut["not_leased_from"], front)
        self.leases.clear()
        self.ahead.clear()
        self._lost_at.clear()
        self._handed_over.clear()
        return again

    # ------------------------------------------------------------------ internals
    def _task_at(self, pos: int) -> TaskDef:
        """The task at position `pos` of the current epoch's order."""
        shard, start, end = self._range(pos)
        return TaskDef(self._base + pos, self.epoch, self.shards[shard].uri, start, end)

    def _range(self, pos: int) -> tuple[int, int, int]:
        """(shard index, start, end) of the task at position `pos`, as cut (a hand-over may end a lease before)."""
        number = self._order[pos]
        shard = bisect.bisect_right(self._first, number) - 1
        start = (number - self._first[shard]) * self.records_per_task
        return shard, start, min(self.shards[shard].rows, start + self.records_per_task)

    def _commit(self, task: TaskDef, lo: int, hi: int) -> int:
        if hi <= lo:
            return 0
        pos = task.task_id - self._base
        acct = self.accounts[task.epoch]
        if self._complete[pos]:
            acct.double_applied += hi - lo
            return 0
        intervals = self._partial.get(task.task_id)
        overlap = 0
        if intervals is None:  # the task's first report
            merged = [[lo, hi]]
        elif len(intervals) == 1 and intervals[0][1] == lo:  # the usual next one: its lease's next minibatches
            merged = intervals
            merged[0][1] = hi
        else:
            overlap = sum(max(0, min(hi, e) - max(lo, s)) for s, e in intervals)
            merged = []
            for s, e in sorted([*intervals, [lo, hi]]):
                if merged and s <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], e)
                else:
                    merged.append([s, e])
        whole = len(merged) == 1 and merged[0][0] == task.start and merged[0][1] >= task.end  # the lease's end
        if whole and merged[0][1] == self._range(pos)[2]:  # and the task's, which a hand-over may put after it
            self._complete[pos] = 1
            self._partial.pop(task.task_id, None)
        else:
            self._partial[task.task_id] = merged
        acct.double_applied += overlap
        acct.committed += (hi - lo) - overlap
        return (hi - lo) - overlap

    def _complete_epoch(self) -> bool:
        return not self.queue and not self.leases and self.account.committed >= self.account.records

    def _maybe_finish_epoch(self) -> None:
        if not self.done and self._complete_epoch() and not (self.hold_epochs and self.evaluated < self.epoch):
            self._advance_epoch()

    def _advance_epoch(self) -> None:
        """The next epoch's tasks, in a new order (the same for the same seed), under new task ids."""
        self.epoch += 1
        self._handed_over.clear()  # a straggler's reports of a past epoch are refused as any stale ones
        self._partial.clear()
        self._order_text = None
        size = 0 if self.done else self.tasks_per_epoch
        if size:
            self.accounts.append(EpochAccount(epoch=self.epoch, records=self.records_per_epoch))
            rng = np.random.default_rng([self.seed % 2**64, self.epoch])
            self._order = array.array("i", rng.permutation(size).astype(np.int32).tobytes())
        else:
            self._order = array.array("i")
        self._base = self._next_id
        self._next_id += size
        self._complete = bytearray(size)
        self.queue.reset(size)

    def summary(self) -> dict:
        return {
            "records_per_epoch": self.records_per_epoch,
            "records_per_task": self.records_per_task,
            "epochs": [a.as_dict() for a in self.accounts],
        }


def _encode(array: np.ndarray) -> str:
    """An array's bytes, compressed, as JSON text."""
    return base64.b64encode(zlib.compress(array.tobytes(), 1)).decode("ascii")


def _decode(text: str, dtype, size: int) -> np.ndarray:
    try:
        array = np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype)
    except (ValueError, zlib.error) as e:
        raise ConfigError(f"the checkpoint's ledger is corrupt ({e}): pass --resume never to start over") from None
    if array.size != size:
        raise ConfigError(
            f"the checkpoint's ledger holds {array.size} entries where this job's data makes {size}: "
            "it is of other data or another records_per_task; pass --resume never to start over"
        )
    return array
