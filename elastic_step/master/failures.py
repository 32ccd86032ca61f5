"""The failures instances and the master report: the job's, which ends it, and the workers' own, which the
relaunch policy weighs when the worker ends."""

from __future__ import annotations

import threading
from collections.abc import Callable

from elastic_step.master.timeline import Timeline


class FailureReports:
    def __init__(self, timeline: Timeline, job_failed: Callable[[], None]):
        """`job_failed`: called once, with the job's failure (training is over)."""
        self._lock = threading.Lock()
        self.timeline = timeline
        self.job_failed = job_failed
        self.failure: dict | None = None  # the job's: the first, the one reported to the user
        # A worker's failure not known to be the user's, by instance, until the relaunch policy sees it end.
        self._internal: dict[str, dict] = {}

    def report(self, instance: str, kind: str, message: str, tb: str, minibatch: str = "") -> None:
        """The job fails; the first failure is the one reported to the user. A worker's "internal" failure (an
        error not known to be the user's) does not fail it: it is kept for the relaunch policy, which decides
        when the worker ends (see `take`). `minibatch`: the records it failed on, when known."""
        with self._lock:
            self.timeline.record("failure", instance, f"{kind}{f' on {minibatch}' if minibatch else ''}: {message}")
            report = {"instance": instance, "kind": kind, "message": message, "traceback": tb, "minibatch": minibatch}
            if kind == "internal":
                self._internal[instance] = report
            elif self.failure is None:
                self.failure = report
                self.job_failed()

    def take(self, instance: str) -> dict | None:
        """The failure `instance` reported before it ended, if any (once)."""
        with self._lock:
            return self._internal.pop(instance, None)
