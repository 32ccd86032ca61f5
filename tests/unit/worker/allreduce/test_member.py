"""A step's contributions ride in the allreduced buffer: summing the members' slots hands every member
all of them, exactly, for record indices far beyond float32's 2**24; the learning rate follows the members
that trained in the step."""

from __future__ import annotations

import numpy as np

from elastic_step.data.accounting import skipped_key
from elastic_step.worker.allreduce.member import contribution_slots, contributions, step_lr_scale


def test_the_sum_of_the_members_slots_is_every_contribution_exactly():
    world = 3
    mine = [(7, 2, 50_000_000_000, 50_000_000_064), None, (0, 0, 0, 16)]  # rank 1 had no data this step
    total = sum(contribution_slots(c, rank, world) for rank, c in enumerate(mine))
    assert total.dtype == np.float32
    assert contributions(total) == [mine[0], mine[2]]


def test_a_member_without_data_contributes_nothing():
    assert contributions(contribution_slots(None, 0, 2)) == []


def test_a_skipped_minibatch_rides_under_its_data_shards_complement():
    skipped = (3, skipped_key(3, 5)[1], 1_000_000_000, 1_000_000_032)
    total = contribution_slots(skipped, 1, 2) + contribution_slots((3, 0, 0, 32), 0, 2)
    assert contributions(total) == [(3, 0, 0, 32), skipped]


def test_the_learning_rate_follows_the_members_that_trained_in_the_step():
    """A step one member trains alone (the other's lease ran out) is half the global batch: half the rate."""
    both, alone = [(0, 0, 0, 16), (0, 1, 512, 528)], [(0, 1, 528, 544)]
    skipped = [(0, 1, 544, 560), (0, skipped_key(0, 0)[1], 16, 32)]
    assert step_lr_scale("scaled", both, 2) == 1.0
    assert step_lr_scale("scaled", alone, 2) == 0.5
    assert step_lr_scale("scaled", skipped, 2) == 0.5  # a skipped minibatch trains nothing
    assert step_lr_scale("scaled", both, 4) == 0.5  # two of four: the job at half strength
    assert step_lr_scale("fixed", alone, 2) == 1.0
