"""Chaos on the local backend, in both strategies: seeded random SIGKILLs and SIGTERMs to workers,
fired on training progress, several per run, and every record still applied exactly once.

The witnesses are not the ledger: the trained weights of the tally model (tests/models/tally.py)
count each record's applications, and the summary's audit lays the model state's own accounting
(the PS shards', or the allreduce members') over the data set.
"""
from __future__ import annotations

import pytest

from tests.integration.harness import train
from tests.models.witness import (TALLY_MODEL, assert_audit_exact, assert_chaos_fired,
                                  assert_each_record_applied_exactly)

pytestmark = pytest.mark.slow

EPOCHS = 12


@pytest.mark.parametrize("strategy, seed", [("ps", 3), ("allreduce", 5)])
def test_random_kills_and_terms_lose_nothing_and_apply_nothing_twice(tally_data, tmp_path, strategy, seed):
    signals = 3
    extra = ("--num-ps", "2") if strategy == "ps" else ("--global-batch", "fixed")
    proc, summary = train(tally_data, tmp_path, "--strategy", strategy,
                          "--epochs", str(EPOCHS), "--max-workers", "2", "--minibatch-size", "32",
                          "--records-per-task", "128", *extra, "--chaos", f"random:{signals}:seed={seed}",
                          model=TALLY_MODEL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fired = assert_chaos_fired(summary, signals)
    assert {f["action"] for f in fired} <= {"kill", "term"}
    assert summary["workers"]["relaunched"] >= sum(f["action"] == "kill" for f in fired)
    assert_each_record_applied_exactly(tmp_path, tally_data, EPOCHS)
    assert_audit_exact(summary, strategy)
