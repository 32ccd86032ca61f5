"""The training job's own threads."""

import concurrent.futures
import os
import threading

from elastic_step.master.job import EVALUATOR_NICENESS, yield_to_training


def test_the_evaluator_thread_yields_the_cores_to_training_and_the_master_keeps_its_priority():
    before = os.getpriority(os.PRIO_PROCESS, 0)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, initializer=yield_to_training) as evaluator:
        niceness = evaluator.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert niceness == max(before, EVALUATOR_NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # the calling thread's own
