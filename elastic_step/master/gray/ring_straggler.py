"""Stragglers (allreduce): a member so much slower than the others that every step waits on it.

A step commits once every member is ready for it, so the ring goes at its slowest member's pace: one member 10x
slower makes every step 10x slower, not only an epoch's tail as in ps (master/gray/straggler.py). A ring of N-1 at full
pace beats N at a straggler's pace whenever it is more than N/(N-1) times slower, so the master leaves such a member
out of the ring: the path of a hung one (fenced, stopped through the backend, its lease remainder requeued, the
ring re-formed without it), and it is replaced, since a new instance may land on a healthy node. A replacement as
slow again is left out for good: the node, or the data it reads, is slow, not the launch.

A member's pace is its own: the time it took for a step's minibatches (StepReadyRequest.step_compute_s, each step
of the run it commits), per record, the median of its last WINDOW committed steps. Not the time to its StepReady:
the ring's collective comes before it and ends every member's step together. So what holds the ring as a whole (a
checkpoint's hold, a ring re-forming, a newcomer's weight pull) is nobody's pace; a member's first SKIP steps of a
launch (it traces the model, fills its pipeline) are not counted, nor steps committed while the master evaluates an
epoch (its process competes for the CPU). A machine that is busy slows every member alike, and the decision is a
ratio of paces.

Plain data, no clock and no threads: the coordinator calls it under its lock.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics

FACTOR = 4.0  # a member at least this many times slower than the others' median is a straggler (as in ps)
WINDOW = 20  # committed steps whose paces make a member's pace
SKIP = 3  # a member's first steps with records of a launch: tracing, not pace
MIN_SAMPLES = 10  # steps before a member's pace counts
# The least a straggler must cost each step: below it, a model so small that a scheduler's hiccup is a large ratio,
# and leaving a member out (a ring re-formed, a replacement started: seconds) would take long to pay back; lower,
# a healthy replacement on a loaded machine is left out (docs/benchmarks.md, Gray failures).
MIN_COST_S = 0.02


@dataclasses.dataclass(frozen=True)
class Straggler:
    """What the master decided: `worker` leaves the ring (replaced, or for good when `again`)."""

    worker: str
    step_s: float  # the straggler's median time for a step's minibatches
    others_step_s: float  # the others' (the median of their medians)
    ratio: float  # its time per record against the others' median
    members: int  # the ring's size with it
    again: bool  # a replacement of an instance already left out for this

    @property
    def action(self) -> str:
        return "left out of the ring for good" if self.again else "left out of the ring, replaced"

    def figures(self) -> dict:
        return {
            "step_s": round(self.step_s, 4),
            "others_step_s": round(self.others_step_s, 4),
            "ratio": round(self.ratio, 1),
            "members": self.members,
            "action": self.action,
        }

    def __str__(self) -> str:
        why = f"a ring of {self.members - 1} at full pace beats {self.members} at its pace"
        if self.again:
            why += "; its previous launch was left out for the same"
        return (
            f"{self.step_s:.3f} s a step against {self.others_step_s:.3f} s for the others "
            f"({self.ratio:.1f}x a record, {why}): {self.action}"
        )


class RingPaceWatch:
    def __init__(self, factor: float = FACTOR, window: int = WINDOW, skip: int = SKIP, min_samples: int = MIN_SAMPLES):
        self.factor, self.window, self.skip, self.min_samples = factor, window, skip, min_samples
        self._steps: dict[str, int] = {}  # member -> its committed steps with records in this launch
        self._samples: dict[str, collections.deque[tuple[float, int]]] = {}  # member -> (compute_s, records)
        self._left_out: set[str] = set()  # instances left out once: a replacement as slow goes for good
        self.quiet = False  # the master evaluates an epoch: what is committed meanwhile is no pace

    def committed(self, steps: dict[str, tuple[float, float]]) -> None:
        """A step committed: each member's (compute_s, records) for it. A member without records or without a
        time (an older worker) gives no sample."""
        for worker, (compute_s, records) in steps.items():
            if records <= 0 or compute_s <= 0:
                continue
            seen = self._steps[worker] = self._steps.get(worker, 0) + 1
            if seen > self.skip and not self.quiet:
                self._samples.setdefault(worker, collections.deque(maxlen=self.window)).append((compute_s, records))

    def forget(self, worker: str) -> None:
        """Gone: its replacement (a new node, perhaps) measures its pace afresh."""
        self._steps.pop(worker, None)
        self._samples.pop(worker, None)

    def _pace(self, worker: str) -> tuple[float, float] | None:
        """(seconds a record, seconds a step), medians, once it has MIN_SAMPLES."""
        samples = self._samples.get(worker, ())
        if len(samples) < self.min_samples:
            return None
        return statistics.median(s / n for s, n in samples), statistics.median(s for s, _ in samples)

    def pick(self, members: list[str], min_workers: int) -> Straggler | None:
        """The member to leave out, if any: the slowest, when it is FACTOR times the others' median or more, the
        ring left without it keeps min_workers, and leaving it out pays (more than N/(N-1) times slower)."""
        n = len(members)
        if n < 2 or n - 1 < min_workers:
            return None
        paces = {w: p for w in members if (p := self._pace(w)) is not None}
        if len(paces) < 2:
            return None
        slowest = max(paces, key=lambda w: paces[w][0])
        others = [p for w, p in paces.items() if w != slowest]
        per_record = statistics.median(p[0] for p in others)
        ratio = paces[slowest][0] / per_record
        others_step = statistics.median(p[1] for p in others)
        if ratio < self.factor or ratio <= n / (n - 1) or paces[slowest][1] - others_step < MIN_COST_S:
            return None
        again = slowest in self._left_out
        self._left_out.add(slowest)
        return Straggler(slowest, paces[slowest][1], others_step, ratio, n, again)
