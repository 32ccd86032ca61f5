"""A durable step on the local backend: checkpoints at one consistent cut, a master SIGKILLed mid-epoch
(or mid-checkpoint) whose step is run again with the same job id and output, and bad checkpoints.

Exactly-once is checked through the tally model's trained weights and the PS shards' audit, never
through the ledger: the ledger is the very state being restored.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from elastic_step.spec import cli_args
from tests.integration.harness import SMALL_LEASES, run_cli, train
from tests.integration.test_errors import assert_clean_error
from tests.models import tally
from tests.models.paced import paced_model
from tests.models.witness import TALLY_MODEL as TALLY
from tests.models.witness import assert_audit_exact, assert_chaos_fired, assert_each_record_applied_exactly

pytestmark = pytest.mark.slow

EPOCHS = 4
# The durable job: the tally model on two workers and two PS.
RING_LEASE_S = 0.02  # allreduce: each lease's feed() sleeps this long
JOB = {"model": TALLY, "job_id": "durable", "epochs": EPOCHS, "max_workers": 2, "num_ps": 2, **SMALL_LEASES}


def tally_job(data, out, *extra, **params):
    """The durable job, checkpointed every 3000 committed records, with `params` laid over it and the literal
    flags `extra` (`--chaos ...`)."""
    return train(data, out, *extra, **(JOB | {"checkpoint_every": 3000} | params))


def manifest(out) -> dict:
    return json.loads((out / "checkpoints" / "durable" / "checkpoint.json").read_text())


def test_a_master_killed_mid_epoch_is_resumed_by_the_retried_step_and_every_record_applied_once(tally_data, tmp_path):
    # As a pipeline step runs it: each attempt has an output of its own (gone with its pod), and the
    # checkpoints are under --checkpoint-uri, by job id.
    total = tally_data["rows"] * EPOCHS
    killed_at = int(total * 0.55)
    ckpts = tmp_path / "bucket"
    proc, _ = tally_job(tally_data, tmp_path / "attempt-1", "--chaos", f"kill:master@{killed_at}", checkpoint_uri=ckpts)
    assert proc.returncode == -9, proc.stderr[-3000:]  # the chaos fired: the master died mid-run
    assert not (tmp_path / "attempt-1" / "summary.json").exists()
    cut = json.loads((ckpts / "durable" / "checkpoint.json").read_text())
    # The kill fired at `fired` records (its journal beside the checkpoints), after any cut that was due first.
    fired = json.loads((ckpts / "durable" / "chaos.json").read_text())["fired"][-1]["at_records"]
    assert killed_at <= fired and 0 < cut["records_committed"] <= fired
    # A retry whose model changed through a setting model() reads is refused as bad input (exit 2, as in allreduce),
    # naming the variable, and leaves the checkpoint to the retry with the model as it was.
    changed = {tally.UNITS_ENV: "2"}
    proc, _ = tally_job(tally_data, tmp_path / "changed", checkpoint_uri=ckpts, env=changed)
    assert_clean_error(proc, f"checkpoint {cut['id']}", "'tally_", "2) float32 in this model", "the model changed")
    assert proc.returncode == 2 and json.loads((ckpts / "durable" / "checkpoint.json").read_text()) == cut
    out = tmp_path / "attempt-2"
    proc, summary = tally_job(tally_data, out, checkpoint_uri=ckpts)  # the retried step
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming job durable from checkpoint" in proc.stderr
    restarts = summary["checkpoints"]["restarts"]
    assert [r["from_checkpoint"] for r in restarts] == [cut["id"]]
    # Counted from the lost master's watermark: at most what it committed after the cut (two reports of a
    # task each may land in the tick that fires the kill).
    assert 0 <= restarts[0]["records_trained_again"] <= fired + 2 * 128 - cut["records_committed"]
    assert summary["checkpoints"]["written"] >= 1
    assert_each_record_applied_exactly(out, tally_data, EPOCHS)
    assert_audit_exact(summary)
    assert not (ckpts / "durable").exists()  # done: a rerun of the job starts over


def test_allreduce_a_lost_ring_and_then_a_lost_master_both_go_back_to_the_last_checkpoint(tally_data, tmp_path):
    """No parameter servers: a checkpoint is a member's weights and optimizer state at a committed step,
    cut while no further step may commit. A ring whose every member is lost goes back to it (not to the
    start), and so does the retried step of a killed master, whose first members all load it."""
    total = tally_data["rows"] * EPOCHS
    # The tally counts 1 per step. A lone member trains its epochs in a tenth of a second each: each lease's
    # feed() sleeps, so that the job outlasts the turns of the master's pump that fire its chaos.
    allreduce = {"strategy": "allreduce", "global_batch": "fixed", "model": paced_model(TALLY, tmp_path, RING_LEASE_S)}
    proc, _ = tally_job(
        tally_data,
        tmp_path,
        "--chaos",
        f"kill:worker-0@{int(total * 0.4)}",
        "--chaos",
        f"kill:master@{int(total * 0.7)}",
        **allreduce,
        min_workers=1,
        max_workers=1,
    )
    assert proc.returncode == -9, proc.stderr[-3000:]  # the master's chaos fired
    assert "every allreduce member was lost" in proc.stderr and "goes back to checkpoint" in proc.stderr
    cut = manifest(tmp_path)
    assert "members.npz" in cut["files"]
    # A retry whose model changed through a setting model() reads (its file unchanged) is refused, naming the
    # variable, as bad input (exit 2, as in ps mode), and leaves the checkpoint to the retry with the model as it was.
    proc, _ = tally_job(tally_data, tmp_path, **allreduce, env={tally.UNITS_ENV: "2"})
    assert_clean_error(
        proc, f"Cannot load checkpoint {cut['id']}: 'tally_", "(3000, 2) float32 in this model", "--job-id"
    )
    assert proc.returncode == 2 and proc.stderr.count("elastic-step: error:") == 1
    assert manifest(tmp_path) == cut
    # The retried step with two workers (the checkpoint does not fix the world size): both load it.
    proc, summary = tally_job(tally_data, tmp_path, **allreduce, min_workers=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = [
        p.name
        for p in (tmp_path / "logs").glob("worker-*.log")
        if f"loaded checkpoint {cut['id']}'s state" in p.read_text()
    ]
    assert {"worker-0.1.log", "worker-1.1.log"} <= set(loaded), loaded  # the retry's launches (logs append)
    assert [r["from_checkpoint"] for r in summary["checkpoints"]["restarts"]] == [cut["id"]]
    assert summary["allreduce"]["checksum_mismatches"] == 0
    assert_each_record_applied_exactly(tmp_path, tally_data, EPOCHS)
    assert_audit_exact(summary, "allreduce")


def test_a_master_stopped_by_sigterm_cuts_a_last_checkpoint_and_its_retry_trains_nothing_again(tally_data, tmp_path):
    """SIGTERM is how Kubernetes stops the step's pod (eviction, preemption, a stopped run), with a
    grace period: the master cuts one more checkpoint, holding the workers after it, stops every
    worker and PS it started, and exits 143 (killed by SIGTERM: a retry policy retries that)."""
    total = tally_data["rows"] * EPOCHS
    asked_at = int(total * 0.45)
    proc, summary = tally_job(tally_data, tmp_path, "--chaos", f"term:master@{asked_at}", checkpoint_every="1h")
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "chaos: SIGTERM the master" in proc.stderr  # the chaos fired
    assert "terminated (SIGTERM)" in proc.stderr and "Traceback" not in proc.stderr
    assert summary["status"] == "failed" and not (tmp_path / "model.keras").exists()
    pids = [
        int(m.group(1))
        for e in summary["events"]
        if e["kind"] == "started"
        for m in [re.match(r"pid (\d+)", e["detail"])]
        if m
    ]
    assert len(pids) >= 4, summary["events"]  # 2 PS + 2 workers, none left running
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", pid
    cut = manifest(tmp_path)
    assert cut["id"] == 2 and cut["records_committed"] >= asked_at  # after the initial one: cut on SIGTERM
    assert f"resumes from checkpoint 2 at {cut['records_committed']} committed records" in proc.stderr
    proc, summary = tally_job(tally_data, tmp_path, checkpoint_every="1h")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (restart,) = summary["checkpoints"]["restarts"]
    assert restart["from_checkpoint"] == 2 and restart["records_trained_again"] == 0
    assert_each_record_applied_exactly(tmp_path, tally_data, EPOCHS)
    assert_audit_exact(summary)
    assert not (tmp_path / "checkpoints").exists()  # the default root goes with the job's last checkpoint


def test_a_master_killed_while_writing_a_checkpoint_resumes_from_the_previous_one_and_only_as_itself(
    tally_data, tmp_path
):
    proc, _ = tally_job(tally_data, tmp_path, "--chaos", "kill:master@checkpoint=2")
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert manifest(tmp_path)["id"] == 1  # checkpoint 2's parts exist, its manifest not
    assert (tmp_path / "checkpoints" / "durable" / "ckpt-000002" / "ledger.json").exists()
    # The same job with another configuration: refused, naming the difference; nothing is started.
    proc, _ = train(tally_data, tmp_path, **(JOB | {"epochs": EPOCHS + 1}))
    assert_clean_error(proc, f"epochs: checkpoint {EPOCHS}, this job {EPOCHS + 1}", "--resume never")
    proc, summary = tally_job(tally_data, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["from_checkpoint"] for r in summary["checkpoints"]["restarts"]] == [1]
    assert_each_record_applied_exactly(tmp_path, tally_data, EPOCHS)
    assert_audit_exact(summary)


def test_a_corrupt_checkpoint_is_a_clear_error(tally_data, tmp_path):
    (tmp_path / "checkpoints" / "durable").mkdir(parents=True)
    (tmp_path / "checkpoints" / "durable" / "checkpoint.json").write_text("{not json")
    proc, _ = tally_job(tally_data, tmp_path)
    assert_clean_error(proc, "checkpoint.json is corrupt", "--resume never")
    assert (tmp_path / "checkpoints" / "durable" / "checkpoint.json").read_text() == "{not json"  # untouched


def test_an_unwritable_checkpoint_location_is_an_error_at_the_start(tally_data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoints").write_text("a file where the checkpoints folder goes")
    proc = run_cli("train", *cli_args(model_def=TALLY, train_data=tally_data["train"], output=out, epochs=1))
    assert_clean_error(proc, "Cannot write checkpoints under", "--checkpoint-every 0")
    assert not (out / "logs").exists() or not any((out / "logs").iterdir())  # nothing was started


def test_a_lost_ps_is_relaunched_every_shard_and_the_ledger_go_back_and_workers_stay_up(tally_data, tmp_path):
    total = tally_data["rows"] * EPOCHS
    proc, summary = tally_job(tally_data, tmp_path, "--chaos", f"kill:ps-1@{int(total * 0.6)}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_chaos_fired(summary, 1)
    restores = summary["checkpoints"]["ps_restores"]
    assert [r["ps"] for r in restores] == [1], restores
    assert summary["workers"]["relaunched"] == 0 and summary["workers"]["lost"] == 0  # workers stayed up
    assert summary["ledger"]["records_trained_again"] == restores[0]["records_trained_again"]
    assert_each_record_applied_exactly(tmp_path, tally_data, EPOCHS)
    assert_audit_exact(summary)


def test_a_lost_ps_and_then_a_lost_master_in_one_run(tally_data, tmp_path):
    total = tally_data["rows"] * EPOCHS
    proc, _ = tally_job(
        tally_data, tmp_path, "--chaos", f"kill:ps-0@{int(total * 0.3)}", "--chaos", f"kill:master@{int(total * 0.7)}"
    )
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert "ps-0 lost: every shard and the ledger go back to checkpoint" in proc.stderr
    # The retried step loses ps-1 as soon as it runs, while the shards are being restored: that loss
    # rewinds them all again, and the restore it interrupted must not undo the rewind.
    proc, summary = tally_job(tally_data, tmp_path, "--chaos", "kill:ps-1@0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_chaos_fired(summary, 1)
    assert len(summary["checkpoints"]["restarts"]) == 1
    assert [r["ps"] for r in summary["checkpoints"]["ps_restores"]] == [1]
    assert_each_record_applied_exactly(tmp_path, tally_data, EPOCHS)
    assert_audit_exact(summary)
