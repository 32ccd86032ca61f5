"""The digits MLP (samples/digits/model.py) with a simulated accelerator, for the Kubernetes tests
and bench/two_jobs.py: in a worker pod every minibatch of RECORDS_PER_STEP records takes at least
SIMULATED_STEP_MS more (40 unless the environment says otherwise). A job then lasts long enough for
the scheduler to preempt a worker and for its replacement to join, and a slot behaves like a
device, whatever this machine's speed. The master (outside pods: no ELASTIC_STEP_POD_IP) evaluates
at full speed.

The process kubelet's pods inherit its environment, so SIMULATED_STEP_MS must be set before the control plane
starts. Pods that run an installed elastic_step (the image's) find the digits sample where DIGITS_SAMPLE says (set
it through the job's `env`). A worker feeds a whole lease at once (on its loader thread, ahead of its steps), hence a
delay per record: a lease of 128 records costs 4 steps' time before its minibatches train.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import time

import elastic_step

STEP_MS_ENV = "SIMULATED_STEP_MS"
SAMPLE_ENV = "DIGITS_SAMPLE"
DEFAULT_STEP_MS = 40.0
RECORDS_PER_STEP = 32

# The digits sample DIGITS_SAMPLE names, else that of the checkout whose elastic_step runs this (an editable
# install), not the one beside this file: a model file may be served alone to the job's pods
# (master/input_server.py), away from its folder.
_spec = importlib.util.spec_from_file_location(
    "elastic_step_slow_digits",
    os.environ.get(SAMPLE_ENV)
    or pathlib.Path(elastic_step.__file__).resolve().parents[1] / "samples" / "digits" / "model.py",
)
_digits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_digits)

model, loss, optimizer, eval_metrics = _digits.model, _digits.loss, _digits.optimizer, _digits.eval_metrics


def step_seconds() -> float:
    return float(os.environ.get(STEP_MS_ENV, DEFAULT_STEP_MS)) / 1000


def feed(batch):
    if os.environ.get("ELASTIC_STEP_POD_IP"):
        time.sleep(step_seconds() * len(next(iter(batch.values()))) / RECORDS_PER_STEP)
    return _digits.feed(batch)
