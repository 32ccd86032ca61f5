"""The evaluator's priority: its thread's, and that of the TensorFlow pools that do its work."""

import concurrent.futures
import os
import subprocess
import sys
import textwrap
import threading

from elastic_step.master.evaluator import NICENESS, lower_priority


def test_the_evaluator_thread_yields_the_cores_to_training_and_the_master_keeps_its_priority():
    before = os.getpriority(os.PRIO_PROCESS, 0)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, initializer=lower_priority) as pool:
        niceness = pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert niceness == max(before, NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # the calling thread's own


# In a fresh process (TensorFlow's runtime starts once per process): an evaluation of a convolution, and the CPU time
# each thread of the process spent on it, by the thread's niceness.
EVALUATION = """
import os, sys
import numpy as np
from elastic_step.master.evaluator import evaluator

pool = evaluator() if sys.argv[1] == "evaluator" else None
import keras

model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3), keras.layers.Conv2D(32, 3),
                          keras.layers.Flatten(), keras.layers.Dense(10)])
x = np.random.rand(1024, 28, 28, 1).astype(np.float32)
model.predict(x[:8], verbose=0)  # built and traced first, as the master's own model is before the curve
if pool is None:
    import concurrent.futures
    from elastic_step.master.evaluator import lower_priority
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, initializer=lower_priority)

def cpu():
    out = {}
    for t in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            fields = open(f"/proc/{os.getpid()}/task/{t}/stat").read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        out[t] = (int(fields[11]) + int(fields[12]), int(fields[16]))  # utime + stime in ticks, niceness
    return out

before = cpu()
pool.submit(lambda: [model.predict(x, verbose=0, batch_size=256) for _ in range(4)]).result()
niced = rest = 0
for t, (ticks, nice) in cpu().items():
    spent = ticks - before.get(t, (0, 0))[0]
    niced, rest = (niced + spent, rest) if nice > 0 else (niced, rest + spent)
print(niced, rest)
"""


def evaluation_cpu(how: str) -> tuple[int, int]:
    """(CPU ticks spent at a lowered priority, ticks spent at the process's own) by an evaluation."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(EVALUATION), how], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    niced, rest = map(int, proc.stdout.split()[-2:])
    return niced, rest


def test_an_evaluation_runs_at_the_evaluators_priority_pools_included():
    niced, rest = evaluation_cpu("evaluator")
    assert niced > 0 and rest <= 0.1 * (niced + rest), (niced, rest)


def test_a_thread_lowered_alone_leaves_most_of_its_evaluation_at_full_priority():
    # What the evaluator's start of the runtime is for: without it, TensorFlow's own threads do the work.
    niced, rest = evaluation_cpu("thread")
    assert rest > niced, (niced, rest)
