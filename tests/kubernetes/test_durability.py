"""A durable step on the real control plane: the master (the real CLI, with the shipped Role's rights
only) SIGKILLed mid-epoch and run again with the same job id and output, and a PS pod deleted
mid-epoch. Both in one run is tests/kubernetes/test_chaos.py's `ps` case (a worker and the master
SIGKILLed, then a PS pod deleted). Exactly-once is checked through the tally weights and the PS shards'
audit, not the ledger (the state being restored)."""

from __future__ import annotations

import subprocess

from tests.kubernetes.jobs import tally_job, train
from tests.kubernetes.test_backend import job_pods, priority_classes, sa_kubeconfig  # noqa: F401
from tests.models.witness import assert_chaos_fired, assert_each_record_applied_exactly, assert_exactly_once

EPOCHS = 6


def master(data, out, job, kubeconfig, namespace, *chaos: str) -> tuple[subprocess.CompletedProcess, dict]:
    return train(
        kubeconfig,
        namespace,
        *[a for c in chaos for a in ("--chaos", c)],
        **tally_job(job, data, out, EPOCHS, num_ps=2, checkpoint_every=3000),
    )


def test_a_deleted_ps_pod_is_relaunched_and_restored_and_workers_stay_up(
    control_plane, core, node, namespace, tally_data, priority_classes, sa_kubeconfig, tmp_path
):
    total = tally_data["rows"] * EPOCHS
    proc, summary = master(
        tally_data, tmp_path, "durable-ps", sa_kubeconfig, namespace, f"kill:ps-1@{int(total * 0.5)}"
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_chaos_fired(summary, 1)
    assert [r["ps"] for r in summary["checkpoints"]["ps_restores"]] == [1]
    assert summary["workers"]["relaunched"] == 0
    assert_exactly_once(summary)
    assert_each_record_applied_exactly(tmp_path, tally_data, EPOCHS)
    assert job_pods(core, namespace, "durable-ps") == []


def test_a_killed_master_the_retried_step_takes_over_the_jobs_pods_and_resumes(
    control_plane, core, node, namespace, tally_data, priority_classes, sa_kubeconfig, tmp_path
):
    """SIGKILL leaves the job's pods running, pointed at a master that is gone: the retried step finds
    them (by job id), replaces them, restores the shards and the ledger from the checkpoint."""
    total = tally_data["rows"] * EPOCHS
    proc, _ = master(
        tally_data, tmp_path, "durable-master", sa_kubeconfig, namespace, f"kill:master@{int(total * 0.5)}"
    )
    assert proc.returncode == -9, proc.stderr[-4000:]
    left = job_pods(core, namespace, "durable-master")
    assert left, "the killed master's pods should outlive it"
    proc, summary = master(tally_data, tmp_path, "durable-master", sa_kubeconfig, namespace)  # the retried step
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "adopting" in proc.stderr and "resuming job durable-master from checkpoint" in proc.stderr
    (restart,) = summary["checkpoints"]["restarts"]
    assert restart["records_committed_at_checkpoint"] > 0
    assert_exactly_once(summary)
    assert_each_record_applied_exactly(tmp_path, tally_data, EPOCHS)
    assert job_pods(core, namespace, "durable-master") == []
