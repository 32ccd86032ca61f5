"""Fault injection's hook points: the few named places where the runtime lets a fault in.

Each does nothing in production: a `JobFaults` method that returns at once, or a `Hook` whose call
checks one attribute. They import nothing of the package, so every layer of the runtime may call them. What
drives them is in elastic_step/faults/: chaos.py, the specs of `--chaos` and ELASTIC_STEP_CHAOS, and process.py,
ELASTIC_STEP_COLLECTIVE_CHAOS (tests, benchmarks, the demo); the Kubernetes tests hold the pod watch through
WATCH_REQUEST themselves.

A job's hook points, on the object `faults.chaos.for_job` makes at the job's start (one per job, so
that jobs in one process never share them):
- `check_backend(backend)`: the job's backend, once made: a fault it cannot deliver fails the job there, before
  anything trains;
- `tick(committed, backend, coord)`: every turn of the master's pump;
- `checkpoint_written(ckpt_id)`: between a checkpoint's parts and its manifest (its commit point);
- `resume(journal, job_id, resumable)`: the job has checkpoints, and `journal` beside them keeps what fires;
- `instance_env(inst)`: variables for an instance's environment, at each launch (a worker's own faults);
- `kill_deferred(inst, backend)`: a worker was declared hung and fenced, and is about to be killed: how long its
  kill waits for it to end by itself (0: not at all), so a fault can resume it first (a zombie: a pod in its grace
  period, a partitioned node whose network returns);
- `summary()`: summary.json's `chaos` section, or None for none;
- `close()`: the job's instances are stopped: what the faults made for them (files they looked for) is removed.

A process's hook points, installed by whoever drives them:
- COLLECTIVE_UNDER_WAY(step, flush): a ring all-reduce member has sent its own chunk of `step` and
  received nothing yet; `flush()` returns once what it sent has left.
- PUMP_TURN(committed): the master's pump begins a turn, `committed` records in; held there, the pump
  stalls (what the step's health endpoint, master/health.py, reports) while its threads go on.
- WATCH_REQUEST(watch): the Kubernetes pod watch (a PodWatch) is about to open a request; held
  there, it leaves what the pods do meanwhile unseen.
- STEP_DONE(seconds): a worker computed a training step (ps: a minibatch's gradient; allreduce: a step's
  minibatches), which took `seconds`; held there, the worker is that much slower.
"""

from __future__ import annotations

from collections.abc import Callable


class JobFaults:
    """A job's hook points; this one injects nothing (see the module)."""

    def check_backend(self, backend) -> None:
        pass

    def tick(self, committed: int, backend, coord) -> None:
        pass

    def checkpoint_written(self, ckpt_id: int) -> None:
        pass

    def resume(self, journal: str, job_id: str, resumable: bool = True) -> None:
        pass

    def instance_env(self, inst) -> dict[str, str]:
        return {}

    def kill_deferred(self, inst, backend) -> float:
        return 0.0

    def summary(self) -> dict | None:
        return None

    def close(self) -> None:
        pass


NO_FAULTS = JobFaults()


class Hook:
    """A process's named hook point: calling it does nothing until a fault is installed."""

    def __init__(self, name: str):
        self.name = name
        self.fault: Callable[..., None] | None = None

    def __call__(self, *args) -> None:
        if self.fault is not None:
            self.fault(*args)

    def install(self, fault: Callable[..., None] | None) -> None:
        """Let `fault` in here (None: take it out again)."""
        self.fault = fault


COLLECTIVE_UNDER_WAY = Hook("a step's collective is under way")
PUMP_TURN = Hook("the master's pump begins a turn")
WATCH_REQUEST = Hook("the pod watch opens a request")
STEP_DONE = Hook("a worker computed a training step")
