"""/metrics over real HTTP, read from a real coordinator as the job's state changes: Prometheus' own parser reads
what the step serves, and the figures follow the ledger, the membership and the losses by cause."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from elastic_step.backends.api import EventKind, InstanceEvent, InstanceId
from elastic_step.master.health import METRICS_PATH, Health, HealthServer
from elastic_step.master.leases.coordinator import Coordinator
from elastic_step.master.leases.ledger import Ledger, ShardInfo
from elastic_step.master.observe.goodput import Goodput
from elastic_step.master.observe.metrics import JobMetrics, JobState
from elastic_step.master.relaunch import loss_cause

W0, W1, W2 = (InstanceId("worker", i) for i in range(3))


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{METRICS_PATH}", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_follow_the_job_state_when_scraped():
    coord = Coordinator(Ledger([ShardInfo("s", 640)], 64, 2, 32), num_ps=0)
    coord.training_started = True
    metrics = JobMetrics()
    evaluation = {"epoch": 0, "accuracy": 0.5}
    served = metrics.watch(
        JobState(
            job_id="j1",
            coord=coord,
            goodput=Goodput(),
            hung=lambda: 1,
            left_out=lambda: 0,
            relaunches=lambda: 1,
            checkpoints=lambda: {"written": 2, "checkpoints": [{"hold_s": 0.5, "held_s": 0.25, "write_s": 2.0}]},
            evaluation=lambda: evaluation,
        )
    )
    server = HealthServer(Health(), 0, "127.0.0.1", metrics.render)
    try:
        for w in (W0, W1, W2):
            coord.membership.launched(w, relaunch=False)
        coord.membership.registered(W0)
        coord.membership.on_event(InstanceEvent(EventKind.WAITING, W1, detail="Kueue has not admitted it"))
        lease = coord.get_task(W0)
        coord.report_progress(W0, lease.task.task_id, lease.task.end, 0.1, False)
        lost = InstanceEvent(EventKind.LOST, W2, detail="preempted by Kueue (pod j1-worker-2): priority")
        coord.on_instance_event(lost)
        coord.count_worker_loss(loss_cause(lost))
        served.served("GetTask", 0.002)
        served.refused("Heartbeat", "PERMISSION_DENIED")
        served.lease_waited(0.3)
        coord.worker_spent(W0, 1, 2.0, 0.5)
        coord.worker_spent(W0, 1, 3.0, 1.0)  # cumulative: the launch's figures so far, not more of them
        coord.worker_spent(W2, 1, 4.0, 2.0)  # a launch gone: its last figures stay
        coord.shard_pushes(InstanceId("ps", 0), 10, 1)
        coord.shard_pushes(InstanceId("ps", 1), 20, 2)
        coord.shard_pushes(InstanceId("ps", 1), 30, 2)  # what the shard holds now
        got = scrape(server.port)
    finally:
        server.stop()
    job = (("job", "j1"),)
    assert got[("elastic_step_records_committed_total", job)] == 64
    assert got[("elastic_step_epoch", job)] == 0
    assert got[("elastic_step_epoch_records", job)] == 640
    states = {dict(k[1])["state"]: v for k, v in got.items() if k[0] == "elastic_step_workers"}
    assert states == {"pending": 0, "queued": 1, "training": 1, "lost": 1, "fenced": 0, "hung": 1, "straggling": 0}
    losses = {dict(k[1])["cause"]: v for k, v in got.items() if k[0] == "elastic_step_worker_losses_total"}
    assert losses["kueue"] == 1 and sum(losses.values()) == 1, losses
    assert got[("elastic_step_checkpoints_total", job)] == 2
    assert got[("elastic_step_checkpoint_hold_seconds", job)] == 0.75
    assert got[("elastic_step_eval_metric", (("job", "j1"), ("metric", "accuracy")))] == 0.5
    assert got[("elastic_step_master_rpc_duration_seconds_count", (("call", "GetTask"), ("job", "j1")))] == 1
    refused = (("call", "Heartbeat"), ("code", "PERMISSION_DENIED"), ("job", "j1"))
    assert got[("elastic_step_master_rpc_errors_total", refused)] == 1
    assert got[("elastic_step_lease_wait_seconds_sum", job)] == 0.3
    assert 0 <= got[("elastic_step_goodput_ratio", job)] <= 1
    assert got[("elastic_step_worker_step_seconds_total", job)] == 7.0
    assert got[("elastic_step_worker_wait_seconds_total", (("job", "j1"), ("on", "ps")))] == 3.0
    assert got[("elastic_step_ps_pushes", (("job", "j1"), ("result", "applied")))] == 40
    assert got[("elastic_step_ps_pushes", (("job", "j1"), ("result", "skipped")))] == 3


def test_a_loss_is_counted_by_its_cause():
    def cause(kind, detail="", code=None):
        return loss_cause(InstanceEvent(kind, W0, exit_code=code, detail=detail, time=time.time()))

    assert cause(EventKind.LOST, "preempted by Kueue (pod p): WorkloadEvictedDueToPreempted") == "kueue"
    assert cause(EventKind.LOST, "evicted (PodsReadyTimeout) by Kueue (pod p)") == "kueue"
    assert cause(EventKind.LOST, "preempted by the scheduler (pod p deleted)") == "preempted"
    assert cause(EventKind.LOST, "pod p deleted: EvictionByEvictionAPI: drained") == "preempted"
    assert cause(EventKind.LOST, "killed by SIGKILL", -9) == "killed"
    assert cause(EventKind.LOST, "declared hung, then killed by SIGKILL") == "hung"
    assert cause(EventKind.LOST, "left out as a straggler, then killed by SIGKILL") == "straggler"
    assert cause(EventKind.LOST, "fenced, then exit code 75") == "fenced"
    assert cause(EventKind.EXITED, code=1) == "crash"
