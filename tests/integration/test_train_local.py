"""Elastic training on the local backend: real worker/PS subprocesses, real gRPC, real TensorFlow.

One undisturbed run and one where a worker is SIGKILLed mid-epoch and another SIGTERMed: the
second must finish with an exact ledger and the same accuracy.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.harness import CTR_MODEL, LEASES_OUTLAST_A_KILL, SMALL_LEASES, train
from tests.models.witness import assert_exactly_once

pytestmark = pytest.mark.slow

# Long enough (~170k records: about 12 s of training for two workers here, at ~14k records/s) that
# a killed worker's replacement starts TensorFlow (~5 s), joins and trains.
EPOCHS = 120
SETTINGS = {"epochs": EPOCHS, "max_workers": 2, "num_ps": 1, **SMALL_LEASES}


@pytest.fixture(scope="module")
def undisturbed(digits_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("undisturbed")
    proc, summary = train(digits_data, out, **SETTINGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, summary, proc


def test_digits_trains_to_090(undisturbed):
    out, summary, proc = undisturbed
    assert_exactly_once(summary)
    assert summary["eval"]["accuracy"] >= 0.90
    assert summary["workers"]["max_alive"] == 2
    # Each worker launch's device, as the worker told the master: this machine's TensorFlow is the CPU build.
    cpu = "CPU (TensorFlow's CPU-only build)"
    launches = sorted((d["instance"], d["launch"], d["device"]) for d in summary["workers"]["devices"])
    assert launches == [("worker-0", 1, cpu), ("worker-1", 1, cpu)], launches
    assert f"worker-0 registered, trains on {cpu}" in proc.stderr
    # The default backend, auto, outside a pod: processes of this step, and the log says why.
    assert summary["backend"] == "local" and "backend auto -> local" in proc.stderr
    assert (out / "model.keras").is_file()
    assert (out / "saved_model" / "saved_model.pb").is_file()
    assert summary["throughput_records_per_s"] > 0


def test_kill_and_sigterm_lose_nothing(undisturbed, digits_data, tmp_path):
    _, base, _ = undisturbed
    total = digits_data["rows"] * EPOCHS
    # Chaos fires only while both workers train and the target holds a lease: the SIGTERM comes as
    # soon as worker-0's replacement has joined, whatever this machine's speed.
    proc, summary = train(
        digits_data,
        tmp_path,
        "--chaos",
        f"kill:worker-0@{int(total * 0.1)}",
        "--chaos",
        f"term:worker-1@{int(total * 0.1) + 1}",
        **(SETTINGS | LEASES_OUTLAST_A_KILL),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exactly_once(summary)
    events = summary["events"]
    kinds = [(e["kind"], e["instance"], e["detail"]) for e in events]
    # The kill and the SIGTERM really happened, to live processes.
    assert ("lost", "worker-0", "killed by SIGKILL") in kinds
    assert ("exited", "worker-1", "exit code 0") in kinds
    # Both were replaced and the replacements joined (registered a second time) and trained.
    assert summary["workers"]["lost"] == 2
    assert summary["workers"]["relaunched"] == 2
    registered = [i for k, i, _ in kinds if k == "registered"]
    assert registered.count("worker-0") == 2
    # Remainders were requeued from the backend's event (the master has no timeout that could):
    # in the timeline each requeue follows its worker's loss, recorded under the same lock, with
    # nothing of that worker's in between; and each was leased again (the ledger times every
    # re-lease: how fast is bench/recovery.py's figure, not a test's).
    for i, e in enumerate(events):
        if e["kind"] == "requeued":
            cause = next(p for p in reversed(events[:i]) if p["instance"] == e["instance"] and p["kind"] != "requeued")
            assert cause["kind"] in ("lost", "exited") and cause["t"] <= e["t"], (cause, e)
    assert sum(e["requeued"] for e in summary["ledger"]["epochs"]) > 0
    cut_short = [e for e in events if e["kind"] == "requeued" and not e["detail"].startswith("lease ahead")]
    assert cut_short and len(summary["recovery"]["requeue_latency_s"]) == len(cut_short), (
        summary["recovery"],
        cut_short,
    )
    # Same model quality as the undisturbed run.
    assert abs(summary["eval"]["accuracy"] - base["eval"]["accuracy"]) <= 0.02


def test_ctr_embeddings_split_across_two_ps(ctr_data, tmp_path):
    proc, summary = train(
        ctr_data,
        tmp_path,
        model=CTR_MODEL,
        epochs=2,
        num_ps=2,
        max_workers=2,
        minibatch_size=128,
        records_per_task=1024,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exactly_once(summary)
    # The loss falls: from the initial weights' (the eval curve's first point) to the trained model's.
    initial = summary["eval_history"][0]
    assert initial["epoch"] == -1
    assert summary["eval"]["loss"] < initial["loss"] * 0.95, (initial, summary["eval"])
    shards = {p["shard"]: p for p in summary["ps"]}
    assert set(shards) == {0, 1}
    tables = shards[0]["embedding_rows_touched"].keys()
    assert tables
    for shard, stats in shards.items():
        assert stats["pushes_applied"] > 0
        for table in tables:
            assert stats["embedding_rows_touched"][table] > 0, (shard, table)
            assert all(i % 2 == shard for i in stats["embedding_ids_sample"][table]), (shard, table)
    assert os.path.isfile(tmp_path / "model.keras")


def test_two_workers_at_default_settings_train_as_async_sgd(digits_data, tmp_path):
    """The pipeline's job (the digits sample, 10 epochs, the step's defaults: 2 workers, 1 PS). Alone, a worker
    runs several minibatches a call on its copy of the shard; once the other's pushes show on the shard, one a
    call on the shard's newest values, async SGD, and the job reaches the pipeline's gate. (Several a call with
    both pushing is local SGD, ~150 steps between pulls: this job reached 0.81.)"""
    proc, summary = train(digits_data, tmp_path, epochs=10)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exactly_once(summary)
    assert summary["workers"]["max_alive"] == 2
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("worker-*.log"))
    assert "another worker pushed" in logs, logs[-3000:]
    assert summary["eval"]["accuracy"] >= 0.90, summary["eval"]
