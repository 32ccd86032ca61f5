"""`elastic-step schedule create` against a local HTTP server speaking the KFP v2beta1 REST API.

The fake KFP server below is the one mock allowed in this suite, because a KFP API server cannot run
on this machine. It answers exactly the calls kfp.Client makes for `schedule create` (healthz,
experiments list/create, recurringruns create; pipelines upload is answered too, though creating a
recurring run from a package sends the spec inline) and records each request body. Everything else
is real: the kfp client, the KFP compiler, our CLI.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from elastic_step.errors import ConfigError
from elastic_step.pipelines.schedule import validate_cron

ROOT = pathlib.Path(__file__).resolve().parents[2]
API = "/apis/v2beta1"


class FakeKfp(BaseHTTPRequestHandler):
    calls: list[tuple[str, str, dict]] = []

    def _reply(self, body: dict, code: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if self.headers.get("Content-Type", "").startswith("application/json"):
            return json.loads(raw or b"{}")
        return {"raw_bytes": len(raw)}

    def do_GET(self):
        url = urlparse(self.path)
        self.calls.append(("GET", url.path, parse_qs(url.query)))
        if url.path == f"{API}/healthz":
            return self._reply({"multi_user": False, "pipeline_store": "database"})
        if url.path == f"{API}/experiments":  # get_experiment(experiment_name=...) lists with a filter
            return self._reply({"experiments": [], "total_size": 0})
        return self._reply({"error": f"not faked: GET {url.path}", "code": 5}, 404)

    def do_POST(self):
        url = urlparse(self.path)
        body = self._body()
        self.calls.append(("POST", url.path, body))
        if url.path == f"{API}/experiments":
            return self._reply({**body, "experiment_id": "exp-1", "created_at": "2026-01-01T00:00:00Z"})
        if url.path == f"{API}/pipelines/upload":
            return self._reply({"pipeline_id": "pl-1", "display_name": "uploaded"})
        if url.path == f"{API}/recurringruns":
            return self._reply(
                {**body, "recurring_run_id": "rr-1", "status": "ENABLED", "created_at": "2026-01-01T00:00:00Z"}
            )
        return self._reply({"error": f"not faked: POST {url.path}", "code": 5}, 404)

    def log_message(self, *args):
        pass


@pytest.fixture
def kfp_server():
    FakeKfp.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeKfp)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", FakeKfp.calls
    server.shutdown()
    server.server_close()


def schedule(host: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KFP_DISABLE_EXECUTION_CACHING_BY_DEFAULT"}
    return subprocess.run(
        [sys.executable, "-m", "elastic_step.cli", "schedule", "create", "--host", host, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def all_tasks(spec: dict):
    """Every task of the pipeline spec: the root DAG's and those of nested DAGs (the gate's branch)."""
    yield from spec["root"]["dag"]["tasks"].items()
    for component in spec["components"].values():
        yield from component.get("dag", {}).get("tasks", {}).items()


def test_schedule_create_sends_a_six_field_cron_without_caching_or_catch_up(kfp_server):
    host, calls = kfp_server
    proc = schedule(
        host,
        "--cron",
        "0 0 2 * * *",
        "--experiment",
        "nightly-digits",
        "--name",
        "digits-nightly",
        "--source",
        "gs://bucket/data/",
        "--model-def",
        "gs://bucket/model.py",
        "--publish-uri",
        "gs://bucket/published/",
        "--epochs",
        "12",
        "--max-workers",
        "6",
        "--service-account",
        "elastic-step",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # stdout is only our JSON, whatever kfp.Client prints
    assert result["recurring_run_id"] == "rr-1" and result["cron"] == "0 0 2 * * *"

    assert ("GET", f"{API}/healthz") in [(m, p) for m, p, _ in calls]
    lookup = next(q for m, p, q in calls if m == "GET" and p == f"{API}/experiments")
    assert "nightly-digits" in lookup["filter"][0]  # looked the experiment up by name first
    experiment = next(b for m, p, b in calls if m == "POST" and p == f"{API}/experiments")
    assert experiment["display_name"] == "nightly-digits"

    rr = next(b for m, p, b in calls if m == "POST" and p == f"{API}/recurringruns")
    assert rr["display_name"] == "digits-nightly"
    assert rr["trigger"] == {"cron_schedule": {"cron": "0 0 2 * * *"}}
    assert rr["no_catchup"] is True
    assert int(rr["max_concurrency"]) == 1
    assert rr["experiment_id"] == "exp-1"
    assert rr["mode"] == "ENABLE"
    assert rr["service_account"] == "elastic-step"
    params = rr["runtime_config"]["parameters"]
    assert params["source_uri"] == "gs://bucket/data/" and params["model_def"] == "gs://bucket/model.py"
    assert params["publish_uri"] == "gs://bucket/published/"
    assert params["epochs"] == 12 and params["max_workers"] == 6 and params["backend"] == "auto"

    # With a platform config, kfp.Client sends the pipeline spec and the platform spec side by side.
    spec, platform = rr["pipeline_spec"]["pipeline_spec"], rr["pipeline_spec"]["platform_spec"]
    assert spec["pipelineInfo"]["name"] == "elastic-step-train-eval"
    (executor,) = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values()
    assert executor["podMetadata"]["annotations"]["prometheus.io/scrape"] == "true"  # the training pod still scraped
    tasks = dict(all_tasks(spec))
    assert {"data-prep-op", "elastic-train-op", "evaluate-op", "publish-model-op"} <= set(tasks)
    cached = [name for name, t in tasks.items() if t.get("cachingOptions", {}).get("enableCache")]
    assert cached == [], f"caching is on for {cached}"  # including the publish step inside the gate


@pytest.mark.parametrize(
    "cron", ["0 0 2 * * *", "0 0 9 ? * 2-6", "0 */15 * * * MON-FRI", "30 0 2 1,15 JAN-JUN *", "  0  0 2 * *   * "]
)
def test_valid_six_field_crons_pass(cron):
    assert validate_cron(cron) == " ".join(cron.split())


@pytest.mark.parametrize(
    "cron, complaint",
    [
        ("every night", "6-field"),
        ("0 0 2 * * * *", "It has 7"),
        ("", "It has 0"),
        ("60 0 2 * * *", "second field '60'"),
        ("0 0 24 * * *", "hour field '24'"),
        ("0 0 2 0 * *", "day of month field '0'"),
        ("0 0 2 * 13 *", "month field '13'"),
        ("0 0 2 * * 7", "day of week field '7'"),
        ("0 0 ? * * *", "hour field '\\?'"),
        ("0 0 5-2 * * *", "hour field '5-2'"),
        ("0 */0 * * * *", "minute field"),
        ("@daily x y z w v", "second field"),
    ],
)
def test_a_bad_cron_is_a_clear_error(cron, complaint):
    with pytest.raises(ConfigError, match=complaint):
        validate_cron(cron)


def test_five_fields_get_a_hint():
    with pytest.raises(ConfigError, match='"0 0 2 \\* \\* \\*" runs at second 0'):
        validate_cron("0 2 * * *")


def test_the_cli_rejects_a_five_field_cron_before_calling_the_server(kfp_server):
    host, calls = kfp_server
    proc = schedule(host, "--cron", "0 2 * * *", "--source", "gs://b/d/", "--model-def", "gs://b/m.py")
    assert proc.returncode != 0
    assert "6-field" in proc.stderr and proc.stdout == ""
    assert calls == []
