"""Faults a process injects into itself: its own signals, a worker's kill mid-collective, a slow worker.

Read by `install_worker_faults` as a worker starts:
- ELASTIC_STEP_COLLECTIVE_CHAOS (comma-separated): `worker-1@step=25` SIGKILLs worker-1 in the middle of
  step 25's ring all-reduce, once its own chunk of the step has left (its peers see a peer failure, not a hang).
- ELASTIC_STEP_SLOW: `10` makes this worker ten times slower: after each step but its first (which traces the
  model) it sleeps 9 times as long as the step took (a slow node, or one under heavy contention, that still
  reports), a step far longer than its recent ones (a retrace, a read on a busy machine) counted as twice their
  median: a slow node is slow at its usual pace, not silent for minutes after one long step. `10@/a/gate` does
  so once the file /a/gate exists (looked for after each step until then). The master sets it for the workers
  `--chaos slow:worker-1@R:x10` names (chaos.py), and opens the gate at R records.
- ELASTIC_STEP_SLOW_MAX_S: `1.5` caps each of those sleeps at 1.5 s. The master sets it to a quarter of its hang
  bound: on a machine loaded enough that one step takes a second, nine of them would make the slow worker a hung one.
Apart from chaos.py, so that a worker process loads no more than the hook points it drives.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import statistics
import time

from elastic_step import fault_hooks

COLLECTIVE_ENV = "ELASTIC_STEP_COLLECTIVE_CHAOS"  # a worker's: "worker-1@step=25"
SLOW_ENV = "ELASTIC_STEP_SLOW"  # a worker's: "10" (times slower)
SLOW_MAX_ENV = "ELASTIC_STEP_SLOW_MAX_S"  # a worker's: "1.5" (the longest sleep, seconds)
SLOW_WINDOW = 20  # the steps whose median is a slowed worker's usual step


def kill_self(sig: int) -> None:
    """Send ``sig`` to this process. As PID 1 of a container (no init in the image) the kernel ignores
    every signal the process has no handler for, its own SIGKILL included: still alive after one, it
    exits as the signal would have made it."""
    os.kill(os.getpid(), sig)
    if sig == signal.SIGKILL:
        os._exit(128 + sig)


def install_worker_faults(me: str) -> None:
    """A worker process at its start: the collective kill ELASTIC_STEP_COLLECTIVE_CHAOS asks of `me`, and the
    slowness ELASTIC_STEP_SLOW asks of it, if any."""
    factor, _, gate = (os.environ.get(SLOW_ENV) or "1").partition("@")
    if float(factor) > 1:
        logging.getLogger("elastic_step.worker").warning(
            "chaos: %s runs %s times slower%s", me, factor, f" once {gate} exists" if gate else ""
        )
        fault_hooks.STEP_DONE.install(_slow(float(factor), gate, me, float(os.environ.get(SLOW_MAX_ENV) or "inf")))
    for spec in filter(None, os.environ.get(COLLECTIVE_ENV, "").split(",")):
        name, _, at = spec.partition("@step=")
        if name == me and at.isdigit():
            fault_hooks.COLLECTIVE_UNDER_WAY.install(_collective_kill(int(at)))
            return


def _slow(factor: float, gate: str = "", me: str = "", max_s: float = float("inf")):
    first, shut = [True], [bool(gate)]
    recent: collections.deque[float] = collections.deque(maxlen=SLOW_WINDOW)

    def fault(seconds: float) -> None:
        if first[0]:  # the first step traces the model: its time is no pace, and ten times it would be minutes
            first[0] = False
            return
        recent.append(seconds)
        seconds = min(seconds, 2 * statistics.median(recent))
        if shut[0]:
            if not os.path.exists(gate):  # a stat per step, until the master opens it
                return
            shut[0] = False
            logging.getLogger("elastic_step.worker").warning("chaos: %s runs %g times slower from now", me, factor)
        time.sleep(min((factor - 1) * seconds, max_s))

    return fault


def _collective_kill(at_step: int):
    def fault(step: int, flush) -> None:
        if step == at_step:
            flush()  # its chunk gone: the neighbour is into the step when its peer dies
            logging.getLogger("elastic_step.worker").warning(
                "chaos: SIGKILL myself in the middle of step %d's collective", step
            )
            kill_self(signal.SIGKILL)

    return fault
