"""The master is a good citizen of its step: SIGTERM (the step's pod being deleted) stops every
worker and parameter server it started, and leaves no model behind as if training had finished."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.harness import DIGITS_MODEL, ROOT

pytestmark = pytest.mark.slow


def test_sigterm_to_master_stops_all_instances(digits_data, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "elastic_step.cli", "train", "--model-def", DIGITS_MODEL,
                             "--train-data", digits_data["train"], "--output", str(out), "--epochs", "500",
                             "--max-workers", "2", "--progress", "lines"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Wait until both workers were started, give them time to import TensorFlow and train,
        # then terminate the master.
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if (out / "logs").exists() and len(list((out / "logs").glob("worker-*.log"))) >= 2:
                break
            time.sleep(0.5)
        time.sleep(8)
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "terminated (SIGTERM)" in err
    assert "Traceback" not in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed"
    pids = [int(m.group(1)) for e in summary["events"] if e["kind"] == "started"
            for m in [re.match(r"pid (\d+)", e["detail"])] if m]
    assert len(pids) >= 3  # 1 PS + 2 workers
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", pid
    assert not (out / "model.keras").exists()
