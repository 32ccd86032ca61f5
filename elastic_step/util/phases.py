"""Where a training process's time goes, phase by phase (compute, feed, push, waits, evaluation, checkpoints):
for the throughput bench's profile of a step. Off unless ELASTIC_STEP_PHASES names a directory; then each
process adds up the wall time of its phases and their thread's CPU time, and writes them there, as
<process>.json, when it ends, with the CPU time of its threads alive then, by name (TensorFlow's inter-op pool,
gRPC's; TensorFlow's intra-op threads and Python's own carry the process's name). Off, a phase costs one
attribute read: the hot loop keeps its timers in place."""

from __future__ import annotations

import json
import os
import pathlib
import resource
import threading
import time

from elastic_step.util.process import own_threads

ENV = "ELASTIC_STEP_PHASES"


class _Phase:
    __slots__ = ("c0", "clock", "name", "t0")

    def __init__(self, clock: Clock, name: str):
        self.clock, self.name = clock, name

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc):
        # The thread's CPU: a phase that waits takes none; a TensorFlow call's ops run on TensorFlow's threads.
        self.clock.add(self.name, time.perf_counter() - self.t0, time.thread_time() - self.c0)
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
        self.cpu: dict[str, float] = {}  # the phases' own thread's CPU time
        self._lock = threading.Lock()

    def phase(self, name: str):
        """A context that adds its wall time to `name` (nothing when off)."""
        return _Phase(self, name) if self.on else _OFF

    def span(self, name: str):
        """A phase that also adds the process's CPU time over it (every thread's): for a whole stretch of work."""
        return _Span(self, name) if self.on else _OFF

    def add(self, name: str, seconds: float, cpu: float | None = None) -> None:
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
            self.counts[name] = self.counts.get(name, 0) + 1
            if cpu is not None:
                self.cpu[name] = self.cpu.get(name, 0.0) + cpu

    def dump(self, process: str) -> None:
        """Write the totals to <directory>/<process>.json (when on)."""
        if not self.on:
            return
        with self._lock:
            out = {
                name: {
                    "s": round(s, 6),
                    "n": self.counts[name],
                    **({"cpu": round(self.cpu[name], 6)} if name in self.cpu else {}),
                }
                for name, s in self.seconds.items()
            }
        out["CPU of the process, start to end"] = {"s": round(_cpu(), 6), "n": 1}
        threads: dict[str, list[float]] = {}
        for t in own_threads():
            threads.setdefault(t.name.rstrip("0123456789_-"), []).append(t.cpu_s)  # a pool's threads together
        for name, cpu in threads.items():
            out[f"CPU of its threads named {name}, alive at the end"] = {"s": round(sum(cpu), 6), "n": len(cpu)}
        path = pathlib.Path(self.directory) / f"{process}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, sort_keys=True))


CLOCK = Clock(os.environ.get(ENV))
phase = CLOCK.phase
span = CLOCK.span
dump = CLOCK.dump
