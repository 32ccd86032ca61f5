"""The training report opened in headless Chromium (Debian's `chromium`, installed by scripts/bootstrap).

Driven through the DevTools protocol (websocket-client, already a dependency of the kubernetes client):
the page must load with no console error, no uncaught exception and no request other than the page
itself (self-contained: no fonts, scripts or images fetched), and every chart must be laid out with a
real size. A full-page screenshot is saved for a person to look at (in the test's tmp dir and under
out/test-artifacts/). A control page proves those checks do catch errors and fetches.
"""

from __future__ import annotations

import base64
import contextlib
import json
import pathlib
import shutil
import struct
import subprocess
import time
import urllib.request

import pytest
import websocket

from elastic_step.report import CHART_IDS, write_report
from tests.integration.harness import SMALL_LEASES, train

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "out" / "test-artifacts"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
    "--remote-allow-origins=*",
]


class Page:
    """One headless Chromium with one tab, spoken to over the DevTools protocol."""

    def __init__(self, profile: pathlib.Path, width: int = 800, height: int = 1000):
        exe = shutil.which("chromium")
        assert exe, "Debian's chromium is missing: run scripts/bootstrap (as root it installs it)"
        self.proc = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.time() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert self.proc.poll() is None, "chromium exited at start-up"
            assert time.time() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        page = next(t for t in targets if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self.next_id, self.events = 0, []
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                assert "error" not in msg, (method, msg["error"])
                return msg.get("result", {})
            self.events.append(msg)

    def open(self, url: str) -> None:
        self.events.clear()
        self.call("Page.navigate", url=url)
        deadline = time.time() + 60
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            assert time.time() < deadline, "the page did not finish loading"
            self.events.append(json.loads(self.ws.recv()))
        self.call("Runtime.evaluate", expression="1")  # drain what the load queued

    def problems(self, url: str) -> list[str]:
        """Console errors and warnings, uncaught exceptions, log errors, and any request but the page's own."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.consoleAPICalled" and p["type"] in ("error", "warning", "assert"):
                out.append(f"console.{p['type']}: {[a.get('value') for a in p['args']]}")
            elif m == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails'].get('text')}")
            elif m == "Log.entryAdded" and p["entry"]["level"] in ("error", "warning"):
                out.append(f"log {p['entry']['level']}: {p['entry']['text']}")
            elif m == "Network.requestWillBeSent" and p["request"]["url"] != url:
                out.append(f"request: {p['request']['url']}")
            elif m == "Network.loadingFailed":
                out.append(f"failed load: {p.get('errorText')}")
        return out

    def evaluate(self, expression: str):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in r, r
        return r["result"].get("value")

    def screenshot(self, path: pathlib.Path) -> tuple[int, int]:
        size = self.call("Page.getLayoutMetrics")["cssContentSize"]
        shot = self.call(
            "Page.captureScreenshot",
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
        )
        data = base64.b64decode(shot["data"])
        path.write_bytes(data)
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        return struct.unpack(">II", data[16:24])  # IHDR width, height

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def page(tmp_path):
    p = Page(tmp_path / "profile")
    yield p
    p.close()


CHARTS_JS = """JSON.stringify(%s.map(id => {
  const el = document.getElementById(id);
  if (!el) return {id, missing: true};
  const box = el.getBoundingClientRect();
  return {id, width: box.width, height: box.height, lines: el.querySelectorAll('polyline').length,
          dots: el.querySelectorAll('circle').length, rects: el.querySelectorAll('rect').length,
          labels: [...el.querySelectorAll('text.mlabel')].map(t => t.textContent)};
}))""" % json.dumps(list(CHART_IDS))  # noqa: UP031 - the JavaScript's braces would need doubling in a format


def check_report(page: Page, report: pathlib.Path, shot: pathlib.Path) -> dict:
    url = report.resolve().as_uri()
    page.open(url)
    assert page.problems(url) == []
    charts = {c["id"]: c for c in json.loads(page.evaluate(CHARTS_JS))}
    for chart_id, c in charts.items():
        assert not c.get("missing"), chart_id
        assert c["width"] > 500 and c["height"] > 100, c  # laid out at a readable size
    width, height = page.screenshot(shot)
    assert width >= 700 and height > 1500
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, ARTIFACTS / shot.name)
    return charts


@pytest.mark.slow
def test_the_report_of_a_job_with_a_killed_worker_renders(page, tmp_path):
    from elastic_step.data.prep import prepare

    data = prepare(str(ROOT / "samples" / "digits" / "digits.csv"), str(tmp_path / "data"), label="label", seed=0)
    out = tmp_path / "job"
    proc, summary = train(
        {"train": data.train_uri, "eval": data.eval_uri},
        out,
        # early (2 of 60 epochs, an epoch is ~0.2 s), so the rest (~12 s) outlasts the
        # replacement's start-up (forked from the preloader: its model's build and first
        # step, a few seconds beside the job's own processes on 2 cores): it must rejoin
        # for the charts to mark its return
        "--chaos",
        f"kill:worker-0@{data.train.total_rows * 2}",
        epochs=60,
        **SMALL_LEASES,
        progress="off",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary["workers"]["lost"] == 1 and len(summary["eval_history"]) >= 2

    charts = check_report(page, out / "report.html", tmp_path / "report.png")
    for chart_id in ("chart-loss", "chart-eval", "chart-throughput", "chart-workers"):
        c = charts[chart_id]
        assert c["lines"] >= 1, c
        # the kill and the relaunched worker's return, marked on every time chart
        assert any(label.startswith("worker-0 lost") for label in c["labels"]), c
        assert "worker-0 rejoined" in c["labels"], c
    assert charts["chart-eval"]["dots"] >= 3  # the per-epoch curve and the final evaluation
    assert charts["chart-ledger"]["rects"] >= 20  # a bar per epoch
    assert page.evaluate("document.querySelectorAll('#ledger tbody tr').length") == summary["epochs"]
    assert page.evaluate("document.getElementById('status').textContent") == "succeeded"


def test_the_report_of_a_failed_job_renders(page, tmp_path):
    summary = {
        "status": "failed",
        "job_id": "es-failed",
        "records_per_epoch": 1438,
        "epochs": 2,
        "error": {
            "kind": "model_error",
            "instance": "worker-1",
            "message": "feed() raised ValueError",
            "traceback": "Traceback (most recent call last):\n  ...\nValueError: <pixel_99>",
        },
        "ledger": {
            "epochs": [{"epoch": 0, "records": 1438, "committed": 0, "lost": 1438, "double_applied": 0, "requeued": 0}]
        },
        "workers_alive": [{"t": 0.0, "alive": 0}, {"t": 5.0, "alive": 2}],
        "events": [
            {"t": 5.1, "kind": "training_started", "instance": "", "detail": ""},
            {"t": 5.2, "kind": "failure", "instance": "worker-1", "detail": "model_error: feed()"},
        ],
    }
    write_report(summary, str(tmp_path / "report.html"))
    charts = check_report(page, tmp_path / "report.html", tmp_path / "report-failed.png")
    assert "job failed (model_error)" in charts["chart-workers"]["labels"]
    assert page.evaluate("document.getElementById('error').textContent").startswith("The job failed.")


def test_the_checks_catch_console_errors_exceptions_and_fetches(page, tmp_path):
    """A control: a page that logs an error, throws and fetches from the network fails every check."""
    bad = tmp_path / "bad.html"
    bad.write_text(
        '<!DOCTYPE html><html><body><img src="http://fetch.invalid/x.png">'
        '<script>console.error("boom"); undefinedFunction();</script></body></html>'
    )
    url = bad.resolve().as_uri()
    page.open(url)
    found = "\n".join(page.problems(url))
    assert "console.error: ['boom']" in found
    assert "exception: Uncaught" in found
    assert "request: http://fetch.invalid/x.png" in found
