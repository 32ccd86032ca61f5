"""The audit lays the PS shards' applied ranges over the data set: each way of getting it wrong shows."""

from __future__ import annotations

import numpy as np

from elastic_step.data.accounting import AppliedRecords, skipped_key
from elastic_step.master.durability.audit import EXACT, UNAVAILABLE, VIOLATED, audit, coverage, describe
from elastic_step.ps.api import PushKey

ROWS = [100, 37]


def applied(*keys: PushKey) -> dict:
    records = AppliedRecords()
    for k in keys:
        records.add(k.epoch, k.data_shard, k.seq, k.end)
    return records.arrays()


def every_record(epochs: int, minibatch: int = 16) -> list[PushKey]:
    """One push per minibatch of every shard and epoch, in the order a lease's minibatches go."""
    return [
        PushKey(0, lo, min(rows, lo + minibatch), e, s)
        for e in range(epochs)
        for s, rows in enumerate(ROWS)
        for lo in range(0, rows, minibatch)
    ]


def test_each_record_once_on_every_shard_is_exact_and_touching_ranges_are_merged():
    keys = every_record(2)
    evidence = [applied(*keys), applied(*reversed(keys))]
    result = audit(ROWS, 2, evidence)
    assert result["verdict"] == EXACT, result
    assert [e["applied_once"] for e in result["epochs"]] == [137, 137]
    assert evidence[0][(0, 0)].tolist() == [[0, 100]]  # in order: one range per shard and epoch
    assert "exact" in describe(result)


def test_a_record_applied_twice_under_another_key_is_caught():
    keys = every_record(1) + [PushKey(99, 20, 30, 0, 1)]  # a re-push the idempotency key did not catch
    result = audit(ROWS, 1, [applied(*keys)])
    assert result["verdict"] == VIOLATED
    assert result["epochs"][0] | {"applied_once": 127, "more_than_once": 10, "never": 0} == result["epochs"][0]
    assert "10 more than once" in describe(result)


def test_a_lost_minibatch_and_a_missing_epoch_are_caught():
    keys = [k for k in every_record(2) if not (k.epoch == 0 and k.data_shard == 1 and k.seq == 16)]
    result = audit(ROWS, 3, [applied(*keys)])
    assert [e["never"] for e in result["epochs"]] == [16, 0, 137]
    assert result["verdict"] == VIOLATED


def test_shards_that_disagree_are_not_counted_as_once():
    keys = every_record(1)
    result = audit(ROWS, 1, [applied(*keys), applied(*keys[1:])])  # shard 1 never applied the first push
    assert result["epochs"][0]["shards_disagree"] == 16 and result["epochs"][0]["applied_once"] == 121
    assert result["verdict"] == VIOLATED


def test_records_outside_the_data_are_a_violation():
    keys = every_record(1) + [PushKey(5, 100, 116, 0, 0), PushKey(6, 0, 4, 7, 0)]
    result = audit(ROWS, 1, [applied(*keys)])
    assert result["records_outside_the_data"] == 20 and result["verdict"] == VIOLATED
    assert result["epochs"][0]["applied_once"] == 137


def test_no_evidence_is_no_verdict():
    assert audit(ROWS, 1, [])["verdict"] == UNAVAILABLE


def test_coverage_counts_overlaps():
    assert coverage(6, np.array([[0, 4], [2, 6], [3, 4]])).tolist() == [1, 1, 2, 3, 1, 1]


def test_skipped_records_count_as_skipped_not_lost_and_a_skip_applied_too_is_caught():
    """--skip-non-finite: a minibatch skipped on every shard is accounted for once, as skipped."""
    keys = every_record(1)
    nan = keys[3]  # skipped: never applied

    def holder(*extra_skips: PushKey, applied_too: bool = False) -> dict:
        records = AppliedRecords()
        for k in keys:
            if k != nan or applied_too:
                records.add(k.epoch, k.data_shard, k.seq, k.end)
        for k in (nan, *extra_skips):
            records.add(*skipped_key(k.epoch, k.data_shard), k.seq, k.end)
        return records.arrays()

    result = audit(ROWS, 1, [holder(), holder()])
    assert result["verdict"] == EXACT, result
    assert result["epochs"][0] | {"applied_once": 137 - 16, "skipped": 16, "never": 0} == result["epochs"][0]
    assert result["records_outside_the_data"] == 0
    assert "16 skipped as not finite" in describe(result)
    # Skipped and applied as well, or skipped twice: more than once.
    assert audit(ROWS, 1, [holder(applied_too=True)])["epochs"][0]["more_than_once"] == 16
    assert audit(ROWS, 1, [holder(nan)])["epochs"][0]["more_than_once"] == 16
    # Skipped on one shard and applied on another: the shards disagree.
    skipped_on_one = audit(ROWS, 1, [holder(), applied(*keys)])
    assert skipped_on_one["verdict"] == VIOLATED and skipped_on_one["epochs"][0]["shards_disagree"] == 16
