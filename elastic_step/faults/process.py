"""Faults a process injects into itself: its own signals, and a worker's kill mid-collective.

A worker's spec (ELASTIC_STEP_COLLECTIVE_CHAOS, comma-separated; read by `install_worker_faults` as
the worker starts): `worker-1@step=25` SIGKILLs worker-1 in the middle of step 25's ring all-reduce,
once its own chunk of the step has left (its peers see a peer failure, not a hang). Apart from chaos.py,
so that a worker process loads no more than the hook points it drives.
"""

from __future__ import annotations

import logging
import os
import signal

from elastic_step.faults import api

COLLECTIVE_ENV = "ELASTIC_STEP_COLLECTIVE_CHAOS"  # a worker's: "worker-1@step=25"


def kill_self(sig: int) -> None:
    """Send ``sig`` to this process. As PID 1 of a container (no init in the image) the kernel ignores
    every signal the process has no handler for, its own SIGKILL included: still alive after one, it
    exits as the signal would have made it."""
    os.kill(os.getpid(), sig)
    if sig == signal.SIGKILL:
        os._exit(128 + sig)


def install_worker_faults(me: str) -> None:
    """A worker process at its start: the collective kill ELASTIC_STEP_COLLECTIVE_CHAOS asks of `me`, if any."""
    for spec in filter(None, os.environ.get(COLLECTIVE_ENV, "").split(",")):
        name, _, at = spec.partition("@step=")
        if name == me and at.isdigit():
            api.COLLECTIVE_UNDER_WAY.install(_collective_kill(int(at)))
            return


def _collective_kill(at_step: int):
    def fault(step: int, flush) -> None:
        if step == at_step:
            flush()  # its chunk gone: the neighbour is into the step when its peer dies
            logging.getLogger("elastic_step.worker").warning(
                "chaos: SIGKILL myself in the middle of step %d's collective", step
            )
            kill_self(signal.SIGKILL)

    return fault
