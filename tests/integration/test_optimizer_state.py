"""The optimizer's step count (`optimizer.iterations`), which a learning-rate schedule is read at, is
carried with the weights: through a lost worker, its replacement and the rescaled ring (allreduce),
and through a killed master's resume from a checkpoint (ps).

Proven from the clock model's trained weights (tests/models/clock.py): the number of updates applied,
and the sum of their learning rates, which must be the schedule's at steps 0, 1, 2, ..., each read
once. A member, newcomer or shard that restarted its count would read the larger early rates again.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.harness import SMALL_LEASES, train
from tests.models.clock import clock, expected_rates
from tests.models.paced import paced_model
from tests.models.witness import assert_chaos_fired

pytestmark = pytest.mark.slow

CLOCK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "clock.py")
EPOCHS = 8
LEASE_S = 0.2  # allreduce: a lease's sleep in feed() (2 steps of a lone member)


def test_allreduce_a_lost_worker_and_the_rescaled_ring_keep_the_schedules_step_count(tally_data, tmp_path):
    # `fixed`: the rate is the schedule's alone (world / max-workers scaling is a unit test's), whatever the world.
    ring = {"strategy": "allreduce", "global_batch": "fixed", "min_workers": 1, "max_workers": 2}
    lost_at = int(tally_data["rows"] * EPOCHS * 0.2)
    # Every member's feed() of a lease sleeps: a lone fast member would train the rest of the job before a loaded
    # machine has started the replacement that must join it.
    out = tmp_path / "out"
    proc, summary = train(
        tally_data,
        out,
        "--chaos",
        f"kill:worker-1@{lost_at}",
        model=paced_model(CLOCK, tmp_path, LEASE_S),
        epochs=EPOCHS,
        **ring,
        **SMALL_LEASES,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_chaos_fired(summary, 1)
    worlds = [v["world"] for v in summary["allreduce"]["versions"]]
    assert 2 in worlds and 1 in worlds[worlds.index(2) :] and worlds[-1] == 2, worlds  # shrunk, then rejoined
    # The saved model is one member's; the others' weights equal it (their checksums, taken from the weights
    # at each step): a newcomer that restarted its count would apply other rates than the member it joined.
    assert summary["allreduce"]["checksum_mismatches"] == 0
    updates, rates = clock(str(out / "model.keras"))
    assert updates > 0
    assert rates == pytest.approx(expected_rates(updates), rel=1e-4), (updates, rates)


def test_ps_a_resumed_job_keeps_the_schedules_step_count(tally_data, tmp_path):
    job = {"model": CLOCK, "job_id": "clock", "epochs": EPOCHS, "num_ps": 1, "max_workers": 1, **SMALL_LEASES}
    total = tally_data["rows"] * EPOCHS
    proc, _ = train(tally_data, tmp_path, "--chaos", f"kill:master@{int(total * 0.55)}", checkpoint_every=3000, **job)
    assert proc.returncode == -9, proc.stderr[-3000:]  # the chaos fired: the master died mid-run
    proc, summary = train(tally_data, tmp_path, checkpoint_every=3000, **job)  # the retried step
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(summary["checkpoints"]["restarts"]) == 1, summary["checkpoints"]
    updates, rates = clock(str(tmp_path / "model.keras"))
    assert updates > 0
    assert rates == pytest.approx(expected_rates(updates), rel=1e-4), (updates, rates)
