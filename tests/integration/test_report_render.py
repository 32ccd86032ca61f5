"""The report of a real training run (a worker SIGKILLed mid-epoch), opened in headless
Chromium: it renders with no console errors or failed loads, the charts are in the rendered
DOM, and a screenshot is saved for a person to look at."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

from tests.integration.harness import ROOT, train

pytestmark = pytest.mark.slow

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium(*args: str, profile: pathlib.Path) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium")
    assert exe, "Debian's chromium is missing: scripts/bootstrap installs it"
    return subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr",
                           "--v=0", *args], capture_output=True, text=True, timeout=120)


def test_report_renders_in_chromium(digits_data, tmp_path):
    out = tmp_path / "job"
    total = digits_data["rows"] * 20
    proc, summary = train(digits_data, out, "--epochs", "20", "--minibatch-size", "32", "--records-per-task", "128",
                          "--chaos", f"kill:worker-0@{total // 5}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = out / "report.html"
    assert report.is_file()
    url = report.resolve().as_uri()

    dom = chromium("--dump-dom", url, profile=tmp_path / "p1")
    assert dom.returncode == 0, dom.stderr[-2000:]
    for chart in ("chart-loss", "chart-eval", "chart-throughput", "chart-workers"):
        assert f'id="{chart}"' in dom.stdout
    assert dom.stdout.count("<polyline") >= 4
    assert len(summary["eval_history"]) >= 2  # the eval curve has points from during training
    assert "worker-0 lost" in dom.stdout and "worker-0 rejoined" in dom.stdout  # the kill and the relaunch
    assert 'id="ledger"' in dom.stdout
    console = [l for l in dom.stderr.splitlines() if "CONSOLE" in l or "Failed to load" in l]
    assert not console, console

    shot = tmp_path / "report.png"
    r = chromium("--window-size=760,1400", f"--screenshot={shot}", url, profile=tmp_path / "p2")
    assert r.returncode == 0 and shot.stat().st_size > 20_000, r.stderr[-2000:]
    keep = pathlib.Path(ROOT) / "out" / "test-artifacts"
    keep.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, keep / "report.png")
