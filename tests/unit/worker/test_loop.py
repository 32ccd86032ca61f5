"""The worker loop's pure parts: minibatch boundaries and report coalescing."""
from __future__ import annotations

import types

from elastic_step.worker.loop import coalesce, minibatches


def task(start, end, task_start=0):
    return types.SimpleNamespace(start=start, end=end, task_start=task_start)


def test_minibatches_cover_the_lease_exactly():
    assert minibatches(task(0, 150), 64) == [(0, 64), (64, 128), (128, 150)]
    assert minibatches(task(5, 5), 64) == []


def test_a_remainder_pushes_the_same_keys_as_the_lost_worker():
    full = minibatches(task(512, 1024, task_start=512), 64)
    # The lost worker's watermark was 640, a minibatch end: the remainder re-pushes the same keys.
    remainder = minibatches(task(640, 1024, task_start=512), 64)
    assert remainder == [b for b in full if b[0] >= 640]
    # Wherever a remainder starts, its boundaries snap back to the task's grid after the first.
    odd = minibatches(task(600, 1024, task_start=512), 64)
    assert odd[0] == (600, 640) and odd[1:] == [b for b in full if b[0] >= 640]


def test_coalesce_merges_a_task_but_keeps_duplicates_apart():
    items = [(1, 64, 64, 1.0, False), (1, 128, 64, 3.0, False), (1, 192, 64, 2.0, True), (2, 64, 64, 1.0, False)]
    out = coalesce(items)
    assert out[0] == (1, 128, 128, 2.0, False)
    assert out[1] == (1, 192, 64, 2.0, True)
    assert out[2] == (2, 64, 64, 1.0, False)
