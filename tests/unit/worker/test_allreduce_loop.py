"""A step's contributions ride in the allreduced buffer: summing the members' slots hands every member
all of them, exactly, for record indices far beyond float32's 2**24."""

from __future__ import annotations

import numpy as np

from elastic_step.worker.allreduce_loop import contribution_slots, contributions


def test_the_sum_of_the_members_slots_is_every_contribution_exactly():
    world = 3
    mine = [(7, 2, 50_000_000_000, 50_000_000_064), None, (0, 0, 0, 16)]  # rank 1 had no data this step
    total = sum(contribution_slots(c, rank, world) for rank, c in enumerate(mine))
    assert total.dtype == np.float32
    assert contributions(total) == [mine[0], mine[2]]


def test_a_member_without_data_contributes_nothing():
    assert contributions(contribution_slots(None, 0, 2)) == []
