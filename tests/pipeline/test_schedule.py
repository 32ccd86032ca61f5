"""`elastic-step schedule create` against a local HTTP server speaking the KFP v2beta1 REST API for
the calls kfp.Client makes. This fake is the one mock in the suite, allowed because a KFP API server
cannot run on this machine; everything else (the kfp client, the compiler, our CLI) is real."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from elastic_step.errors import ConfigError
from elastic_step.pipelines.schedule import validate_cron
from tests.integration.harness import ROOT


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
        return json.loads(self.rfile.read(n) or b"{}")

    def do_GET(self):
        self.calls.append(("GET", self.path, {}))
        if self.path.startswith("/apis/v2beta1/healthz"):
            return self._reply({"multi_user": False})
        if self.path.startswith("/apis/v2beta1/experiments"):
            return self._reply({"experiments": [], "total_size": 0})
        return self._reply({"error": f"not faked: GET {self.path}"}, 404)

    def do_POST(self):
        body = self._body()
        self.calls.append(("POST", self.path, body))
        if self.path.startswith("/apis/v2beta1/experiments"):
            return self._reply({**body, "experiment_id": "exp-1"})
        if self.path.startswith("/apis/v2beta1/recurringruns"):
            return self._reply({**body, "recurring_run_id": "rr-1", "status": "ENABLED"})
        return self._reply({"error": f"not faked: POST {self.path}"}, 404)

    def log_message(self, *args):
        pass


@pytest.fixture
def kfp_server():
    FakeKfp.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeKfp)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", FakeKfp.calls
    server.shutdown()


def test_schedule_create_sends_a_six_field_cron_without_caching_or_catch_up(kfp_server):
    host, calls = kfp_server
    proc = subprocess.run([sys.executable, "-m", "elastic_step.cli", "schedule", "create", "--host", host,
                           "--cron", "0 0 2 * * *", "--source", "gs://bucket/data/", "--model-def",
                           "gs://bucket/model.py", "--publish-uri", "gs://bucket/published/"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["recurring_run_id"] == "rr-1"
    experiment = next(b for m, p, b in calls if m == "POST" and "/experiments" in p)
    assert experiment["display_name"] == "elastic-step"
    rr = next(b for m, p, b in calls if m == "POST" and "/recurringruns" in p)
    assert rr["trigger"]["cron_schedule"]["cron"] == "0 0 2 * * *"
    assert rr["no_catchup"] is True
    assert int(rr["max_concurrency"]) == 1
    assert rr["experiment_id"] == "exp-1"
    assert rr["runtime_config"]["parameters"]["source_uri"] == "gs://bucket/data/"
    spec = rr["pipeline_spec"]
    tasks = [t for c in spec["root"]["dag"]["tasks"].values() for t in [c]]
    assert tasks and all(not t.get("cachingOptions", {}).get("enableCache", False) for t in tasks)
    assert spec["pipelineInfo"]["name"] == "elastic-step-train-eval"


@pytest.mark.parametrize("cron", ["0 2 * * *", "every night", "0 0 2 * * * *"])
def test_a_cron_that_is_not_six_fields_is_a_clear_error(cron):
    with pytest.raises(ConfigError, match="6-field"):
        validate_cron(cron)


def test_five_fields_get_a_hint():
    with pytest.raises(ConfigError, match='"0 0 2 \\* \\* \\*" runs at second 0'):
        validate_cron("0 2 * * *")
