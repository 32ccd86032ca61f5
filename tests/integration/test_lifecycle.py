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


def both_workers_pushing(logs) -> bool:
    texts = [p.read_text() for p in (logs / "worker-0.1.log", logs / "worker-1.1.log") if p.exists()]
    return len(texts) == 2 and all("PS shard 0" in t for t in texts)


def test_sigterm_to_master_stops_all_instances(digits_data, tmp_path):
    out, log = tmp_path / "out", tmp_path / "master.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "elastic_step.cli", "train", "--model-def", DIGITS_MODEL,
                                 "--train-data", digits_data["train"], "--output", str(out), "--epochs", "500",
                                 "--max-workers", "2", "--progress", "lines"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, text=True)
    try:
        # Terminate the master while both workers train: each has pushed gradients to the PS (its
        # first push logs which path it takes). The deadline is a safety limit only.
        deadline = time.monotonic() + 300
        while proc.poll() is None and not both_workers_pushing(out / "logs"):
            assert time.monotonic() < deadline, "the workers never pushed gradients: " + log.read_text()[-3000:]
            time.sleep(0.2)
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    assert proc.returncode == 143   # as killed by SIGTERM: a retry policy retries this, not a failed job (1)
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
