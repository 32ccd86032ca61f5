"""Hang detection: a worker that holds work the job waits on and commits nothing for longer than a bound is hung.

A worker that deadlocks, hangs on a read, is cut off from the network or is frozen keeps its lease, and the
backend never says it is gone: only its missing progress does. Progress is a commit: a report the ledger took
(ps), a step whose commit held the worker (allreduce). A worker's clock
  * starts at its first commit of a launch (allreduce: its first step with records): a first step that traces
    for a minute is not a hang;
  * runs only while the worker holds work the job waits on (a lease in ps, a place in the ring in allreduce),
    and only while the job lets it progress: not while it waits in a checkpoint's barrier, a state is being
    restored or an epoch is being evaluated (the caller says who runs, at each tick);
  * counts at most MAX_TICK_S per tick, so that a master that stalls itself charges no worker for it.
The bound is --hang-timeout when given, else max(FLOOR_S, FACTOR × the longest of the worker's last WINDOW
times between commits), measured on the same clock: a worker that is always slow (a slow node, a heavy model)
gets a bound as slow, and one that still reports is never declared hung.

Before its first commit of a launch a worker has a start-up clock instead (it runs on the same terms), and a
start-up bound: max(STARTUP_FLOOR_S, STARTUP_FACTOR × the slowest first commit seen in this job, --hang-timeout).
A first step traces the model, opens the data and fills the pipeline, and nothing before it tells how long that
takes on this job: minutes for a large model is normal. So the floor is minutes, the job's own first steps can
only lengthen it, and --hang-timeout, which is sized for the time between commits, never shortens it. A worker
stuck on its first read is still found, only later than one stuck mid-lease.

Plain data, no clock and no threads: the coordinator calls it under its lock, with `now`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

FLOOR_S = 30.0  # no measured bound is shorter: a GC pause, a slow read or a busy node is not a hang
FACTOR = 10.0  # times the worker's own recent pace
WINDOW = 20  # commits whose spacing makes the pace
MAX_TICK_S = 1.0  # the most one tick counts (the master's pump turns every 0.1 s)
STARTUP_FLOOR_S = 180.0  # no start-up bound is shorter: a first step may trace a large model for minutes
STARTUP_FACTOR = 3.0  # times the slowest first commit seen in this job


@dataclasses.dataclass(frozen=True)
class Hung:
    worker: str
    idle_s: float  # running time since its last commit
    bound_s: float
    measured: bool  # the bound is the measured one (no --hang-timeout)
    what: str = "progress"  # what was missing: progress, a first commit (the start-up bound), an answer (a PS)

    def __str__(self) -> str:
        source = "" if self.measured else ", --hang-timeout"
        idle = f"{self.idle_s:.0f}" if self.idle_s >= 10 else f"{self.idle_s:.1f}"
        bound = "start-up bound" if self.what == FIRST_COMMIT else "bound"
        return f"no {self.what} for {idle} s ({bound} {round(self.bound_s, 1):g} s{source})"


FIRST_COMMIT = "first commit"


@dataclasses.dataclass(frozen=True)
class HangBounds:
    """How long an instance may say nothing: built once, from --hang-timeout, and given to every watch that
    times one (the workers' in the coordinator, the shards' in the PS watch) and to whoever must stay under it."""

    timeout_s: float = 0.0  # --hang-timeout, the bound for everyone; 0: the measured bound
    floor_s: float = FLOOR_S
    factor: float = FACTOR
    window: int = WINDOW

    @property
    def measured(self) -> bool:
        return self.timeout_s <= 0

    def between_commits(self, gaps: Iterable[float]) -> float:
        """The bound of one whose last times between commits were `gaps`."""
        if self.timeout_s > 0:
            return self.timeout_s
        return max(self.floor_s, self.factor * max(gaps, default=0.0))

    @property
    def least(self) -> float:
        """The shortest bound any time between commits gets: --hang-timeout, else the floor."""
        return self.timeout_s if self.timeout_s > 0 else self.floor_s

    def startup(self, slowest_first: float) -> float:
        """Before a first commit of a launch (see the module): --hang-timeout only lengthens it."""
        return max(STARTUP_FLOOR_S, STARTUP_FACTOR * slowest_first, self.timeout_s)


MEASURED = HangBounds()  # no --hang-timeout: every bound from the pace


class HangWatch:
    def __init__(self, bounds: HangBounds = MEASURED):
        self.bounds = bounds
        self._idle: dict[str, float] = {}  # worker -> running seconds since its last commit (once it committed)
        self._starting: dict[str, float] = {}  # worker -> running seconds of this launch before its first commit
        self._slowest_first = 0.0  # the longest start-up clock seen at a first commit, in this job
        self._gaps: dict[str, collections.deque[float]] = {}  # worker -> its last times between commits
        self._running: frozenset[str] = frozenset()  # whose clock ran at the last tick
        self._last_tick: float | None = None

    def committed(self, worker: str) -> None:
        """The worker committed: its clock starts (the first commit of a launch) or starts over."""
        if worker in self._idle:
            self._gaps.setdefault(worker, collections.deque(maxlen=self.bounds.window)).append(self._idle[worker])
        else:
            self._slowest_first = max(self._slowest_first, self._starting.pop(worker, 0.0))
        self._idle[worker] = 0.0

    def forget(self, worker: str) -> None:
        """The worker is gone (or declared hung): its successor's clock starts at its own first commit."""
        self._idle.pop(worker, None)
        self._gaps.pop(worker, None)
        self._starting.pop(worker, None)

    def bound(self, worker: str) -> float:
        return self.bounds.between_commits(self._gaps.get(worker, ()))

    def startup_bound(self) -> float:
        return self.bounds.startup(self._slowest_first)

    def tick(self, now: float, running: Iterable[str]) -> list[Hung]:
        """Advance the clocks of the workers `running` now (that ran at the previous tick too), and return
        those past their bound."""
        running = frozenset(running)
        dt = 0.0 if self._last_tick is None else min(MAX_TICK_S, max(0.0, now - self._last_tick))
        self._last_tick = now
        late = []
        for worker in sorted(running & self._running):
            if worker not in self._idle:  # not committed yet in this launch: the start-up clock
                starting = self._starting[worker] = self._starting.get(worker, 0.0) + dt
                if starting > (bound := self.startup_bound()):
                    late.append(
                        Hung(worker, starting, bound, measured=bound > self.bounds.timeout_s, what=FIRST_COMMIT)
                    )
                continue
            self._idle[worker] += dt
            if self._idle[worker] > (bound := self.bound(worker)):
                late.append(Hung(worker, self._idle[worker], bound, measured=self.bounds.measured))
        self._running = running
        return late

    def idle(self, worker: str) -> float | None:
        return self._idle.get(worker)

    def starting(self, worker: str) -> float | None:
        """The start-up clock of a worker that has not committed in this launch (None: not started, or done)."""
        return self._starting.get(worker)
