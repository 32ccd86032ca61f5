"""Run the real `elastic-step` CLI the way a user or a pipeline step does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable

from elastic_step.spec import cli_args
from tests.infra import zygote

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIGITS_MODEL = os.path.join(ROOT, "samples", "digits", "model.py")
CTR_MODEL = os.path.join(ROOT, "samples", "ctr", "model.py")
TWO_HEADS_MODEL = os.path.join(ROOT, "samples", "digits", "two_heads.py")
# The tests' usual leases: 4 minibatches of 32 (the CLI's defaults are 8 of 64). A test's settings add them
# (`**SMALL_LEASES`) as they add any parameter.
SMALL_LEASES = {"minibatch_size": 32, "records_per_task": 128}
# For a test that kills a worker and requires part of its lease to be requeued: leases of 16 minibatches of
# 32. A lease of 4 lasts about as long as a kill takes to be seen (~13 ms), so the reports already on their
# way could end it and leave nothing to requeue. Laid over a test's settings: `**(SETTINGS | LEASES_OUTLAST_A_KILL)`.
LEASES_OUTLAST_A_KILL = {"records_per_task": 512}


def run_cli(
    *args: str, timeout: float = 600, env: dict | None = None, unset: Iterable[str] = ()
) -> subprocess.CompletedProcess:
    """Run the real `elastic-step` CLI in a process of its own, as a user or a pipeline step does, forked from the
    test process's zygote, which imported TensorFlow once (tests/infra/zygote.py); `env`: variables to add to this
    process's environment; `unset`: variables of it to leave out."""
    inherited = {k: v for k, v in os.environ.items() if k not in set(unset)}
    return zygote.run(
        [sys.executable, "-m", "elastic_step.cli", *args], cwd=ROOT, env={**inherited, **(env or {})}, timeout=timeout
    )


def train(
    data: dict,
    output,
    *extra: str,
    model: str = DIGITS_MODEL,
    env: dict | None = None,
    progress: str = "lines",
    **params,
) -> tuple[subprocess.CompletedProcess, dict]:
    """`elastic-step train` of `model` on `data` ({"train": manifest, "eval": manifest}) into `output`, with
    the job spec's parameters `params` (`epochs=4` -> `--epochs 4`), then the literal flags `extra`
    (`--chaos ...`). Returns the process and the summary it wrote ({} if none)."""
    paths = {"model_def": model, "train_data": data["train"], "eval_data": data["eval"], "output": output}
    proc = run_cli("train", *cli_args(**paths, progress=progress, **params), *extra, env=env)
    summary_path = os.path.join(str(output), "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    return proc, summary


def random_chaos(strategy: str, signals: int, seed: int) -> tuple[str, list[str], dict]:
    """A seeded random schedule of `signals` kills and terms over every role of `strategy`: (the roles, the
    `--chaos` flags, the job settings that give a hit role a peer: two PS shards, or a ring that accumulates
    its fixed global batch while it shrinks)."""
    roles = "worker,ps,master" if strategy == "ps" else "worker,master"
    settings = {"num_ps": 2} if strategy == "ps" else {"global_batch": "fixed"}
    return roles, ["--chaos", f"random:{signals}:seed={seed}:roles={roles}"], settings


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
