"""A real Prometheus scrapes a local job's master (/metrics on its health port) every second while chaos kills one
worker and freezes another; afterwards its PromQL answers agree with the job's summary.json: the records committed,
one loss of each cause injected, and the goodput."""

from __future__ import annotations

import json

import pytest

from elastic_step.spec import cli_args
from tests.infra.prometheus import SCRAPE_INTERVAL_S, Prometheus
from tests.infra.stores.harness import free_port
from tests.integration.harness import LEASES_OUTLAST_A_KILL, SMALL_LEASES, run_cli, train
from tests.models.witness import TALLY_MODEL, assert_chaos_fired, assert_exactly_once

pytestmark = pytest.mark.slow

EPOCHS = 12  # long enough that the killed worker's replacement trains again before the freeze is due
HANG_TIMEOUT = 6  # the frozen worker is declared hung this long after its last progress
WINDOW = "[30m]"  # any sample of the job: the series end with it (staleness), so queries look back


def test_prometheus_scraping_a_job_with_chaos_agrees_with_its_summary(tally_data, tmp_path):
    rows, port = tally_data["rows"], free_port()
    prometheus = Prometheus(tmp_path / "prometheus", [f"127.0.0.1:{port}"])
    try:
        proc, summary = train(
            tally_data,
            tmp_path / "out",
            "--chaos",
            f"kill:worker-0@{rows // 2}",
            "--chaos",
            f"stop:worker-1@{rows * 3}",  # frozen for good: declared hung, fenced, killed and replaced
            model=TALLY_MODEL,
            epochs=EPOCHS,
            max_workers=3,
            hang_timeout=HANG_TIMEOUT,
            health_port=port,
            **(SMALL_LEASES | LEASES_OUTLAST_A_KILL),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert_exactly_once(summary)
        fired = assert_chaos_fired(summary, 2)
        assert [(f["action"], f["instance"]) for f in fired] == [("kill", "worker-0"), ("stop", "worker-1")]

        def last(metric: str, **labels) -> float:
            selector = ",".join([f'job="{summary["job_id"]}"', *(f'{k}="{v}"' for k, v in labels.items())])
            return prometheus.value(f"last_over_time({metric}{{{selector}}}{WINDOW})")

        assert prometheus.query("count_over_time(up[30m])"), "prometheus never scraped the master"
        committed = last("elastic_step_records_committed_total")
        assert committed == summary["ledger"]["records_committed"] == EPOCHS * rows
        assert summary["workers"]["lost_by_cause"] == {"killed": 1, "hung": 1}, summary["workers"]
        for cause, lost in {"killed": 1, "hung": 1, "preempted": 0, "kueue": 0, "crash": 0, "straggler": 0}.items():
            assert last("elastic_step_worker_losses_total", cause=cause) == lost, cause
        assert last("elastic_step_worker_relaunches_total") == summary["workers"]["relaunched"] == 2
        # A ratio of the step's wall time moves by at most dt / wall in dt: the last scrape is within a few intervals
        # of the summary's figures (written as the step ends, while /metrics is still served).
        goodput = summary["goodput"]
        wall = sum(goodput["wall_s"].values())
        tolerance = 3 * SCRAPE_INTERVAL_S / wall
        scraped = last("elastic_step_goodput_ratio")
        assert abs(scraped - goodput["ratio"]) <= tolerance, (scraped, goodput, tolerance)
        assert 0 < goodput["ratio"] < 1 and goodput["wall_s"]["startup"] > 0, goodput
        assert goodput["wall_s"]["waiting"] + goodput["wall_s"]["rewind"] > 0 or goodput["worker_s"]["waiting"] > 0
        # The hung worker's wait is lost worker-seconds: the job trained beside a frozen worker for its bound.
        assert goodput["worker_ratio"] < goodput["ratio"] + tolerance, goodput
        assert prometheus.value(f'max_over_time(elastic_step_workers{{state="hung"}}{WINDOW})') >= 0
        assert last("elastic_step_master_rpc_duration_seconds_count", call="ReportProgress") > 0
        assert last("elastic_step_lease_wait_seconds_count") > 0
        # What only the workers know, through their reports: their steps' time, and their waits on the shards.
        assert last("elastic_step_worker_step_seconds_total") > 0
        assert last("elastic_step_worker_wait_seconds_total", on="ps") > 0
        # ... and the PS shards, through their heartbeats: their pushes applied
        assert last("elastic_step_ps_pushes", result="applied") > 0
    finally:
        prometheus.stop()


def test_allreduce_members_report_their_steps_and_their_time_in_the_ring_and_log_json(tally_data, tmp_path):
    out = tmp_path / "out"
    paths = {"model_def": TALLY_MODEL, "train_data": tally_data["train"], "eval_data": tally_data["eval"]}
    settings = {"strategy": "allreduce", "epochs": 2, "max_workers": 2, "progress": "off", **SMALL_LEASES}
    proc = run_cli("--log-format", "json", "train", *cli_args(**paths, output=out, **settings))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert_exactly_once(summary)
    workers = summary["workers"]
    assert workers["step_s"] > 0 and workers["wait_s"] > 0, workers  # through StepReady, each launch's so far
    # --log-format json: the master's lines, one object each, with the job's id (decided by the CLI) and the role
    lines = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    assert {line["job"] for line in lines} == {summary["job_id"]}, {line["job"] for line in lines}
    assert {line["role"] for line in lines} == {"master"}
    assert [line["event"] for line in lines if line["event"]][-1] == "finished"
    assert sum(line["event"] == "epoch_end" for line in lines) == 2
    # ... and its members' logs are theirs, the same way
    member = [
        json.loads(line) for line in (out / "logs" / "worker-0.1.log").read_text().splitlines() if line[:1] == "{"
    ]
    assert member and {line["role"] for line in member} == {"worker-0"}
    assert {line["job"] for line in member} == {summary["job_id"]}
