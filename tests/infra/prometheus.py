"""A real Prometheus (Debian's `prometheus` package, which scripts/bootstrap installs) for tests: on loopback, with
its data in a test's folder, scraping the targets it is given every second, and its HTTP API's PromQL queries."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

from tests.infra.stores.harness import free_port

SCRAPE_INTERVAL_S = 1


class Prometheus:
    """`prometheus` scraping `targets` ("127.0.0.1:PORT", each a master's health port) at /metrics. The series'
    own `job` label (the training job's id) is kept: `honor_labels`, as docs/observability.md's PodMonitor does.
    `scrape_configs`: more scrape jobs, as Prometheus' configuration spells them (its service discovery among
    them), each every second."""

    def __init__(self, folder: pathlib.Path, targets: list[str] = (), scrape_configs: list[dict] = ()):
        exe = shutil.which("prometheus")
        assert exe, "Debian's prometheus is missing: run scripts/bootstrap (as root it installs it)"
        folder.mkdir(parents=True, exist_ok=True)
        jobs = list(scrape_configs)
        if targets:
            jobs.insert(0, {"job_name": "elastic-step", "honor_labels": True, "static_configs": [{"targets": targets}]})
        config = {
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "scrape_timeout": f"{SCRAPE_INTERVAL_S}s"},
            "scrape_configs": jobs,
        }
        (folder / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.port = free_port()
        self.log = folder / "prometheus.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [
                    exe,
                    f"--config.file={folder / 'prometheus.yml'}",
                    f"--storage.tsdb.path={folder / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.time() + 60
        while True:
            assert self.proc.poll() is None, f"prometheus exited at start-up: {self.log.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, f"prometheus was not ready: {self.log.read_text()[-2000:]}"
            time.sleep(0.2)

    def query(self, promql: str) -> list[dict]:
        """An instant query's result: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=30) as r:
            answer = json.load(r)
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def value(self, promql: str) -> float:
        """The one value `promql` answers (an error when it answers none or several)."""
        result = self.query(promql)
        assert len(result) == 1, f"{promql}: {result}"
        return float(result[0]["value"][1])

    def targets(self) -> list[dict]:
        """The active targets, as its HTTP API lists them (scrapePool, scrapeUrl, health, labels, ...)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/targets?state=active", timeout=30) as r:
            answer = json.load(r)
        assert answer["status"] == "success", answer
        return answer["data"]["activeTargets"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
