"""The job's timeline: what happened when, for summary.json and the report.

Every part of the master writes to it (the coordinator's decisions, the checkpoints, the gray-failure policy,
the relaunch decisions); it decides nothing.
"""

from __future__ import annotations

import time


class Timeline:
    def __init__(self, t0: float | None = None):
        """`t0`: the job's start, which every event's time is counted from."""
        self.t0 = time.time() if t0 is None else t0
        self.events: list[dict] = []  # appended to from any thread: a list's append is atomic

    def record(self, kind: str, instance: str = "", detail: str = "", t: float | None = None, **figures) -> None:
        """An event; `figures`: its numbers, as fields of their own."""
        t = time.time() if t is None else t
        self.events.append(
            {"t": round(t - self.t0, 4), "kind": kind, "instance": instance, "detail": detail, **figures}
        )
