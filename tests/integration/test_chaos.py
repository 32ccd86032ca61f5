"""Chaos on the local backend, in both strategies: seeded random SIGKILLs and SIGTERMs to workers, the
parameter servers and the master itself, fired on training progress, several per run, and every record
still applied exactly once. A killed or terminated master's step is run again, as a retry policy does.

The witnesses are not the ledger: the trained weights of the tally model (tests/models/tally.py)
count each record's applications, and the summary's audit lays the model state's own accounting
(the PS shards', or the allreduce members') over the data set.
"""

from __future__ import annotations

import pytest

from tests.integration.harness import SMALL_LEASES, random_chaos, retried, train
from tests.models import tally
from tests.models.paced import paced_model
from tests.models.witness import TALLY_MODEL, assert_audit_exact, assert_chaos_fired, assert_each_record_applied_exactly

pytestmark = pytest.mark.slow

EPOCHS = 6
# What both tests' jobs share.
JOB = {"model": TALLY_MODEL, "epochs": EPOCHS, "max_workers": 2, "checkpoint_every": 2000}
# allreduce: each lease's feed() sleeps this long. A lone member runs a tally epoch in about a tenth of a second, so
# unpaced, the ring left by a killed worker could train the rest of the job before the worker's replacement
# (TensorFlow's import: about a second) joins it, and leave no lease for a later signal to land in.
RING_LEASE_S = 0.03
# ps, a lone worker on copies of the shards: each lease's feed() sleeps this long. The shard takes its copies' state
# after each call, and the lone worker runs a tally epoch in about a tenth of a second, its checkpoints (every 2,000
# records) due again almost as soon as cut: a signal, which waits for a cut, then found no moment to land in.
LONE_LEASE_S = 0.03


# Seeds whose schedule holds every role asked for (the test checks it): ps: kill worker, term master,
# kill ps-0; allreduce: kill worker, term worker, kill master.
@pytest.mark.parametrize("strategy, seed", [("ps", 6), ("allreduce", 9)])
def test_random_kills_and_terms_lose_nothing_and_apply_nothing_twice(tally_data, tmp_path, strategy, seed):
    signals = 3
    roles, chaos, extra = random_chaos(strategy, signals, seed)
    paced = {"model": paced_model(TALLY_MODEL, tmp_path, RING_LEASE_S)} if strategy == "allreduce" else {}
    codes, (proc, summary) = retried(
        lambda: train(
            tally_data,
            tmp_path,
            *chaos,
            job_id=f"chaos-{strategy}",
            strategy=strategy,
            **{**JOB, **paced},
            **SMALL_LEASES,
            **extra,
        )
    )
    assert proc.returncode == 0, (codes, proc.stderr[-3000:])
    fired = assert_chaos_fired(summary, signals)
    assert {f["instance"].split("-")[0] for f in fired} == set(roles.split(",")), fired  # every role was hit
    assert len(codes) == 2 and codes[0] in (-9, 143), codes  # the master's signal, then its retry
    assert {f["action"] for f in fired} <= {"kill", "term"}
    assert_each_record_applied_exactly(tmp_path, tally_data, EPOCHS)
    assert_audit_exact(summary, strategy)


def _a_worker_and_a_ps_killed(tally_data, tmp_path, **job) -> dict:
    """worker-0 killed 30 % in, ps-1 60 % in (2 shards, minibatches of 32, leases of 256): the job succeeds, both
    fired, and each record is applied once per epoch, by the weights and by the shards' audit. The summary."""
    total = tally_data["rows"] * EPOCHS
    proc, summary = train(
        tally_data,
        tmp_path,
        "--chaos",
        f"kill:worker-0@{total * 3 // 10}",
        "--chaos",
        f"kill:ps-1@{total * 6 // 10}",
        num_ps=2,
        minibatch_size=32,
        records_per_task=256,
        **{**JOB, **job},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_chaos_fired(summary, 2)
    assert_each_record_applied_exactly(tmp_path, tally_data, EPOCHS)
    assert_audit_exact(summary, "ps")
    return summary


def test_pushes_of_several_minibatches_lose_nothing_to_a_lost_worker_and_ps(tally_data, tmp_path):
    """--minibatches-per-push 4: a push's key spans four minibatches. A killed worker's remainder is pushed
    again under the same keys by whoever leases it, and a killed PS's shards are restored to the last
    checkpoint: each record is still applied once per epoch, by the weights and by the shards' audit."""
    total = tally_data["rows"] * EPOCHS
    summary = _a_worker_and_a_ps_killed(tally_data, tmp_path, minibatches_per_push=4)
    # One push per four minibatches of 32: the shard that was never lost applied about total / 128
    # pushes (a few more: a task's last push may be short, and re-pushes after the losses), not total / 32.
    survivor = next(p for p in summary["ps"] if p["shard"] == 0)
    assert 0 < survivor["pushes_applied"] <= total / 128 * 1.25, survivor


@pytest.mark.parametrize("workers", [1, 2])
def test_calls_of_several_minibatches_lose_nothing_to_a_lost_worker_and_ps(tally_data, tmp_path, workers):
    """The tally model without its table: a worker alone runs several minibatches a call on its copies of the
    shards, and pushes each minibatch under its own key; with two, each goes to one a call once the other's
    pushes show, and back. A worker killed mid-call (its call's pushes applied, some or none of them reported)
    and a killed PS (its shard restored to the last checkpoint): each record is still applied once per epoch,
    by the weights and by the shards' audit."""
    paced = paced_model(TALLY_MODEL, tmp_path, LONE_LEASE_S)
    _a_worker_and_a_ps_killed(tally_data, tmp_path, env={tally.TABLE_ENV: "0"}, max_workers=workers, model=paced)
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("worker-*.log"))
    assert "this worker applies their updates to copies of its own" in logs  # the path under test ran
    assert ("another worker pushed" in logs) == (workers == 2), logs[-3000:]  # alone, it never left it
