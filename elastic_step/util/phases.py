"""Where a training process's time goes, phase by phase (compute, feed, push, waits, evaluation, checkpoints):
for the throughput bench's profile of a step. Off unless ELASTIC_STEP_PHASES names a directory; then each
process adds up the wall time of its phases and writes them there, as <process>.json, when it ends. Off, a
phase costs one attribute read: the hot loop keeps its timers in place."""

from __future__ import annotations

import json
import os
import pathlib
import resource
import threading
import time

ENV = "ELASTIC_STEP_PHASES"


class _Phase:
    __slots__ = ("clock", "name", "t0")

    def __init__(self, clock: Clock, name: str):
        self.clock, self.name = clock, name

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.clock.add(self.name, time.perf_counter() - self.t0)
        return False


class _Span(_Phase):
    """A phase that also adds the whole process's CPU time over it, as "<name>: CPU of the process"."""

    __slots__ = ("cpu0",)

    def __enter__(self):
        self.cpu0 = _cpu()
        return super().__enter__()

    def __exit__(self, *exc):
        self.clock.add(f"{self.name}: CPU of the process", _cpu() - self.cpu0)
        return super().__exit__(*exc)


def _cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


class _Off:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_OFF = _Off()


class Clock:
    """Seconds and counts per phase, from any thread (a phase is named by the thread it runs on)."""

    def __init__(self, directory: str | None):
        self.directory = directory
        self.on = bool(directory)
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def phase(self, name: str):
        """A context that adds its wall time to `name` (nothing when off)."""
        return _Phase(self, name) if self.on else _OFF

    def span(self, name: str):
        """A phase that also adds the process's CPU time over it (every thread's): for a whole stretch of work."""
        return _Span(self, name) if self.on else _OFF

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
            self.counts[name] = self.counts.get(name, 0) + 1

    def dump(self, process: str) -> None:
        """Write the totals to <directory>/<process>.json (when on)."""
        if not self.on:
            return
        with self._lock:
            out = {name: {"s": round(s, 6), "n": self.counts[name]} for name, s in self.seconds.items()}
        out["CPU of the process, start to end"] = {"s": round(_cpu(), 6), "n": 1}
        path = pathlib.Path(self.directory) / f"{process}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, sort_keys=True))


CLOCK = Clock(os.environ.get(ENV))
phase = CLOCK.phase
span = CLOCK.span
dump = CLOCK.dump
