"""The digits model (samples/digits/model.py) with a simulated accelerator: in a worker pod every
minibatch of 32 records takes at least STEP_S more, so a job lasts long enough for the scheduler to
preempt a worker, and for its replacement to join, whatever this machine's speed. The master
(outside pods: no ELASTIC_STEP_POD_IP) evaluates at full speed.

A worker feeds a whole lease at once (on its loader thread, ahead of the step), so the delay is
per record: a lease of 128 records costs 4 x STEP_S before its minibatches can be trained."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import time

STEP_S = 0.04
RECORDS_PER_STEP = 32

_spec = importlib.util.spec_from_file_location(
    "elastic_step_test_digits", pathlib.Path(__file__).resolve().parents[2] / "samples" / "digits" / "model.py")
_digits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_digits)

model, loss, optimizer, eval_metrics = _digits.model, _digits.loss, _digits.optimizer, _digits.eval_metrics


def feed(batch):
    if os.environ.get("ELASTIC_STEP_POD_IP"):
        time.sleep(STEP_S * len(next(iter(batch.values()))) / RECORDS_PER_STEP)
    return _digits.feed(batch)
