"""Chaos on the real control plane, in both strategies: a seeded random schedule of SIGKILLs (pod
deleted with grace 0) and SIGTERMs (graceful deletion) of worker and PS pods, and of the master itself,
fired on training progress, with the master as the real CLI holding only the shipped Role's rights.
A killed or terminated master's step is run again with the same job id and output, as a retry policy
does: the new master takes over the job's pods and resumes from the last checkpoint. Every record is still
applied exactly once, by the witnesses of tests/models/witness.py, not by the ledger. In `ps` mode,
pushes carry their bytes over gRPC, and in `allreduce` mode ring links their payloads over TCP, as between
nodes (each pod has its own /dev/shm)."""

from __future__ import annotations

import re

import pytest

from tests.integration.harness import random_chaos, retried
from tests.kubernetes.jobs import tally_job, train
from tests.kubernetes.test_backend import (  # noqa: F401
    assert_pushes_carried_bytes,
    dense_shards,
    job_pods,
    priority_classes,
    sa_kubeconfig,
    worker_logs,
)
from tests.models.witness import assert_audit_exact, assert_chaos_fired, assert_each_record_applied_exactly

EPOCHS = 6


# Seeds whose schedule holds every role asked for: ps: kill worker, kill master (its pods outlive it and
# the retried step adopts them), term ps-0 (the pod deleted); allreduce: kill worker, term worker, term
# master (the last checkpoint cut with commits held).
@pytest.mark.parametrize("strategy, seed", [("ps", 39), ("allreduce", 2)])
def test_random_pod_kills_and_terms_lose_nothing(
    control_plane, core, node, namespace, tally_data, priority_classes, sa_kubeconfig, tmp_path, strategy, seed
):
    signals, job, out = 3, f"chaos-{strategy}", tmp_path / "out"
    roles, chaos, extra = random_chaos(strategy, signals, seed)
    codes, (proc, summary) = retried(
        lambda: train(
            sa_kubeconfig,
            namespace,
            *chaos,
            **tally_job(job, tally_data, out, EPOCHS, strategy=strategy, checkpoint_every=2000, **extra),
        )
    )
    assert len(codes) == 2 and codes[0] in (-9, 143), (codes, proc.stderr[-4000:])  # the master's signal, a retry
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert summary["backend"] == "kubernetes"
    fired = assert_chaos_fired(summary, signals)
    assert {f["instance"].split("-")[0] for f in fired} == set(roles.split(",")), fired  # every role was hit
    assert_each_record_applied_exactly(out, tally_data, EPOCHS)
    assert_audit_exact(summary, strategy)
    if strategy == "ps":  # a worker killed before its first push met no shard: the job as a whole did
        assert_pushes_carried_bytes(worker_logs(node, namespace, job), dense_shards(summary), every_worker=False)
    else:
        logs = "\n".join(worker_logs(node, namespace, job).values())
        assert re.search(r"ring link to worker-\d+: payloads over TCP", logs), logs[-3000:]
        assert "payloads through shared memory" not in logs
    assert job_pods(core, namespace, job) == []
