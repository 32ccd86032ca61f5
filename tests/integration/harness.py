"""Run the real `elastic-step` CLI the way a user or a pipeline step does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIGITS_MODEL = os.path.join(ROOT, "samples", "digits", "model.py")
CTR_MODEL = os.path.join(ROOT, "samples", "ctr", "model.py")
# For a test that kills a worker and requires part of its lease to be requeued: leases of 16 minibatches of
# 32. A lease of 4 lasts about as long as a kill takes to be seen (~13 ms), so the reports already on their
# way could end it and leave nothing to requeue. Passed after a test's settings: the last flag counts.
LEASES_OUTLAST_A_KILL = ("--records-per-task", "512")


def run_cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real `elastic-step` CLI in a subprocess, as a user or a pipeline step does
    (`env`: variables to add to this process's environment)."""
    return subprocess.run(
        [sys.executable, "-m", "elastic_step.cli", *args],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def train(
    data: dict, output, *extra: str, model: str = DIGITS_MODEL, env: dict | None = None
) -> tuple[subprocess.CompletedProcess, dict]:
    proc = run_cli(
        "train",
        "--model-def",
        model,
        "--train-data",
        data["train"],
        "--eval-data",
        data["eval"],
        "--output",
        str(output),
        "--progress",
        "lines",
        *extra,
        env=env,
    )
    summary_path = os.path.join(str(output), "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    return proc, summary


RETRIED = (-9, 143)  # the master was SIGKILLed or SIGTERMed: what a retry policy retries


def retried(run, attempts: int = 4) -> tuple[list[int], object]:
    """`run()` again while its master was killed or terminated, as KFP's set_retry or Argo's
    retryStrategy runs a step again (same job id and output). Returns (every attempt's exit code,
    the last attempt's result); `run()` returns (a CompletedProcess, ...)."""
    codes = []
    for _ in range(attempts):
        result = run()
        codes.append(result[0].returncode)
        if codes[-1] not in RETRIED:
            break
    return codes, result
