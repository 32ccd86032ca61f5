"""Stragglers (ps): a worker so much slower than the others that the end of an epoch waits on it.

Mid-epoch a slow worker costs only its own share: the others take the queue's tasks. At the epoch's end the queue
is empty, the fast workers are idle, and the epoch waits for the straggler's last leases. So when a worker asks
for work and there is none, the master looks for a lease whose holder is at least FACTOR times slower than the
asking worker and would still need MIN_TAIL_S or more at its own pace, and hands part of it over (as MapReduce's
backup tasks, but without running anything twice): the straggler's lease ahead whole, or else the tail of its
current lease, cut where both should finish together. master/leases/ledger.py says why that is exactly-once: the tail
keeps its task id and minibatch boundaries, so the shards apply each of its minibatches once, whoever pushes it
first, and the straggler's reports past the cut are refused (it stops, and asks for new work).

A pace is a worker's records per second between two reports of one lease (a report is a commit), the median of
its last WINDOW: the time it waits for work, a checkpoint's barrier or a pause of the machine is one sample
among many. A machine that is busy slows every worker alike, and the decision is a ratio of paces, so load alone
makes no straggler; contention that falls on one worker more than the others may, for a while, and the hand-over
then costs nothing (exactly-once holds whoever pushes first).

allreduce needs another remedy: a step takes every member's minibatch together, so a slow member slows every
step, not only an epoch's tail. There the master leaves it out of the ring (master/gray/ring_straggler.py).

Plain data, no clock and no threads: the coordinator calls it under its lock, with `now`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics

FACTOR = 4.0  # a holder at least this many times slower than the idle worker is a straggler
MIN_TAIL_S = 0.25  # the least work, at the straggler's pace, worth handing over: about what a lease costs to start
WINDOW = 20  # reports whose paces make a worker's pace
MIN_SAMPLES = 3  # reports before a worker's pace counts
# A search that found nothing is not made again for this long: at an epoch's end every idle worker asks for work
# every 50 ms, and a search looks at every lease (a large job has many).
RESEARCH_S = 0.25


@dataclasses.dataclass(frozen=True)
class Handover:
    """What the master decided: `holder`'s work to `to`."""

    holder: str
    to: str
    task_id: int
    cut: int | None  # the tail [cut, end) of the current lease; None: the lease ahead, whole
    records: int  # how many records change hands
    holder_pace: float  # records/s
    to_pace: float
    holder_s: float  # the straggler's time for all it held, at its pace

    def figures(self) -> dict:
        return {
            "holder_records_per_s": round(self.holder_pace, 1),
            "idle_records_per_s": round(self.to_pace, 1),
            "holder_s": round(self.holder_s, 1),
            "records": self.records,
        }

    def __str__(self) -> str:
        what = "its lease ahead" if self.cut is None else f"the tail [{self.cut}, end)"
        return (
            f"{self.holder_pace:.1f} records/s against {self.to_pace:.1f} for {self.to} "
            f"({self.to_pace / self.holder_pace:.1f}x, {self.holder_s:.1f} s of work left at its pace): "
            f"{what} of task {self.task_id}, {self.records} records, re-leased to {self.to}"
        )


class StragglerWatch:
    def __init__(self, factor: float = FACTOR, min_tail_s: float = MIN_TAIL_S, window: int = WINDOW):
        self.factor, self.min_tail_s, self.window, self.min_samples = factor, min_tail_s, window, MIN_SAMPLES
        self._paces: dict[str, collections.deque[float]] = {}
        self._pace: dict[str, float] = {}  # worker -> the median of its paces, once it has MIN_SAMPLES
        self._last: dict[str, tuple[int, float]] = {}  # worker -> (task_id, when) of its last report
        self._found_nothing_at = float("-inf")

    def reported(self, worker: str, task_id: int, records: int, now: float) -> None:
        """A report of `records` newly committed; a pace sample when the worker's previous one was of this lease."""
        last = self._last.get(worker)
        if last is not None and last[0] == task_id and now > last[1] and records > 0:
            paces = self._paces.setdefault(worker, collections.deque(maxlen=self.window))
            paces.append(records / (now - last[1]))
            if len(paces) >= self.min_samples:
                self._pace[worker] = statistics.median(paces)
        self._last[worker] = (task_id, now)

    def forget(self, worker: str) -> None:
        """Gone: a relaunched worker (on another node, perhaps) measures its pace afresh."""
        self._paces.pop(worker, None)
        self._pace.pop(worker, None)
        self._last.pop(worker, None)

    def pace(self, worker: str) -> float | None:
        return self._pace.get(worker)

    def pick(self, idle: str, ledger, now: float) -> Handover | None:
        """Whose work `idle` (holding no lease, the queue empty) should take, if anyone's: the straggler that would
        take longest, its lease ahead first (all of it is still to do), else the tail of its current lease."""
        to_pace = self.pace(idle)
        if to_pace is None or now - self._found_nothing_at < RESEARCH_S:
            return None
        best = None
        for holder, lease in ledger.leases.items():
            pace = self.pace(holder)
            if holder == idle or pace is None or pace * self.factor > to_pace:
                continue
            ahead = ledger.ahead.get(holder)
            left = lease.task.end - lease.watermark + (ahead.task.end - ahead.watermark if ahead else 0)
            if left / pace >= self.min_tail_s and (best is None or left / pace > best[0]):
                best = (left / pace, holder, pace, lease, ahead)
        if best is None:
            self._found_nothing_at = now
            return None
        holder_s, holder, pace, lease, ahead = best
        if ahead is not None:
            records = ahead.task.end - ahead.watermark
            return Handover(holder, idle, ahead.task.task_id, None, records, pace, to_pace, holder_s)
        # Cut so that both finish together: the straggler keeps pace/(pace+to_pace) of the remainder, rounded up to a
        # minibatch boundary, and at least one minibatch (it is training it now).
        task, mb = lease.task, ledger.minibatch_size
        keep = max(mb, (lease.task.end - lease.watermark) * pace / (pace + to_pace))
        cut = task.start + math.ceil((lease.watermark + keep - task.start) / mb) * mb
        if cut >= task.end or (task.end - cut) / pace < self.min_tail_s / 2:
            return None
        return Handover(holder, idle, task.task_id, cut, task.end - cut, pace, to_pace, holder_s)
