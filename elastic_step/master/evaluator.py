"""The master's evaluator: the thread that computes the eval curve, at a lower CPU priority than training.

On the local backend the workers and shards share the master's cores, so an evaluation should take what they leave
instead of slowing their steps; where the master has a pod of its own, nothing competes and nothing changes.
A thread's niceness is its own on Linux, but TensorFlow runs a model's ops on its own pools' threads, not on the
thread that called it: those pools are made once, when the runtime starts, and their threads inherit the niceness of
the thread that started it. So the master starts TensorFlow's runtime from the evaluator thread, before anything
else in it touches TensorFlow: then the evaluation's work, pools included, runs at the evaluator's priority.
The master's other TensorFlow work (building the model to check its contract, the final evaluation and save) runs
on those pools too; none of it is on the workers' path.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading

log = logging.getLogger("elastic_step.master")

NICENESS = 10


def lower_priority() -> None:
    """This thread's niceness to at least NICENESS (never raised back: an unprivileged process cannot)."""
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, max(os.getpriority(os.PRIO_PROCESS, me), NICENESS))
    except (AttributeError, OSError) as e:  # not Linux, or not allowed: the curve costs what it costs
        log.debug("evaluator thread keeps its priority: %s", e)


def start_runtime() -> None:
    """Start TensorFlow's runtime (its devices and thread pools) from the calling thread."""
    import tensorflow as tf

    tf.constant(0.0).numpy()


def evaluator() -> concurrent.futures.ThreadPoolExecutor:
    """The evaluator thread, with TensorFlow's runtime started from it: call it before the master's first use of
    TensorFlow (a runtime already started keeps the priority it started with)."""
    pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="evaluator", initializer=lower_priority
    )
    pool.submit(start_runtime).result()
    return pool
