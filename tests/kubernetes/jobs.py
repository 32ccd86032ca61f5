"""The master as the real `elastic-step train` CLI against the control plane, as a step runs it: its
command line built from parameter values (elastic_step.spec.cli_args), its environment (a kubeconfig and
a namespace, no pod identity unless given), run to its end or started in the background."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from elastic_step.pipelines.argo import IMAGE
from elastic_step.spec import cli_args
from tests.infra.kube.harness import wait_for
from tests.models.witness import TALLY_MODEL

ROOT = Path(__file__).resolve().parents[2]
# The image of the job's pods when the master runs outside a pod (it has no pod of its own to take the image from).
WORKER_IMAGE = IMAGE
# The project's image as a platform's registry names it: a step's image that is not the project's default.
STEP_IMAGE = "registry.example.com/ml/elastic-step:1.2"

# The shape of most jobs here: 32-record minibatches, 128-record tasks, at most two workers.
SMALL = {"minibatch_size": 32, "records_per_task": 128, "max_workers": 2}
EPOCHS_HELD = 40  # a held job's (run_held): far longer than the test's steps while held, seconds an epoch after
PACE_S = 1.0  # while a job is held, each of its workers feeds one lease (128 records) per PACE_S

# The tally model, paced while the test holds the job (the hold file exists): the job cannot end before the test has
# taken its steps, and the pace is far inside any hang bound.
PACED = """
import time


def feed(batch):
    if os.path.exists({hold!r}):
        time.sleep({pace})
    return tally_feed(batch)
"""


def step_pod_env(pod) -> dict:
    """What KFP tells a step's master of its own pod (the downward API): the master then runs as if in ``pod``."""
    return {"KFP_POD_NAME": pod.metadata.name, "KFP_POD_UID": pod.metadata.uid}


def cli_env(kubeconfig: Path, namespace: str, **extra) -> dict:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "ELASTIC_STEP_NAMESPACE": namespace, **extra}
    for k in ("KFP_POD_NAME", "KFP_POD_UID", "POD_NAME", "POD_UID", "POD_IP", "ELASTIC_STEP_POD_IP"):
        if k not in extra:
            env.pop(k, None)
    return env


def train_command(*flags: str, python: str = sys.executable, **params) -> list[str]:
    """`python -m elastic_step.cli train` with these parameter values, then `flags` (those that are not
    parameters, such as --chaos, as they are). `python`: this interpreter, or a pod's (`python` in the image)."""
    return [python, "-m", "elastic_step.cli", "train", *cli_args(**params), *flags]


def train(kubeconfig: Path, namespace: str, *flags: str, timeout: float = 600, **params):
    """Run the master with backend kubernetes to its end. Returns (the CompletedProcess, the job's summary,
    {} unless it succeeded)."""
    proc = subprocess.run(
        train_command(*flags, backend="kubernetes", **{"worker_image": WORKER_IMAGE, **params}),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(kubeconfig, namespace),
    )
    summary = Path(params["output"]) / "summary.json"
    return proc, json.loads(summary.read_text()) if proc.returncode == 0 and summary.exists() else {}


def start_train(
    kubeconfig: Path, namespace: str, log: Path, step_env: dict | None = None, **params
) -> subprocess.Popen:
    """Start the master with backend kubernetes, its stderr to `log` (`step_env`: variables of the step's
    environment to set, such as its pod's)."""
    with open(log, "w") as err:
        return subprocess.Popen(
            train_command(backend="kubernetes", **{"worker_image": WORKER_IMAGE, **params}),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=cli_env(kubeconfig, namespace, **(step_env or {})),
        )


def wait_two_workers(master: subprocess.Popen, log: Path, what: str) -> None:
    """Until the master (started by start_train) logs both workers registered, or has exited."""
    wait_for(
        lambda: (
            "worker-1 registered" in log.read_text()
            and "worker-0 registered" in log.read_text()
            or master.poll() is not None
        ),
        240,
        interval=0.5,
        what=what,
    )


def tally_job(job: str, data: dict, out: Path, epochs: int, **params) -> dict:
    """The parameters of job `job` training the tally model (tests/models/witness.py: its weights witness
    each record applied) on `data` (tally_data) into `out`, SMALL, progress as lines."""
    return {
        "job_id": job,
        "model_def": TALLY_MODEL,
        "train_data": data["train"],
        "eval_data": data["eval"],
        "output": out,
        "epochs": epochs,
        **SMALL,
        **params,
        "progress": "lines",
    }


def paced_tally(tmp_path: Path, hold: Path) -> str:
    path = tmp_path / "paced_tally.py"
    source = open(TALLY_MODEL).read().replace("def feed(", "def tally_feed(")
    path.write_text(source + textwrap.dedent(PACED.format(hold=str(hold), pace=PACE_S)))
    return str(path)


def registrations(log: Path) -> int:
    """Workers the master (started by start_train) logged as registered so far, relaunches included."""
    return len(re.findall(r"worker-\d+ registered", log.read_text()))


def run_held(
    kubeconfig: Path,
    namespace: str,
    tmp_path: Path,
    tally_data: dict,
    job: str,
    steps,
    diagnose=None,
    env: dict | None = None,
    **params,
):
    """Run job `job` (the tally, EPOCHS_HELD, `params`) held: paced until `steps(master, log)` has returned, then
    released to its end. Returns (its summary, the master's log, its output folder). When a step fails,
    `diagnose()` (if given) says what the cluster held at that moment, beside the master's log. `env`: as
    start_train's (the step's pod)."""
    out, log, hold = tmp_path / "out", tmp_path / "master.log", tmp_path / "hold"
    hold.write_text("")
    params = tally_job(job, tally_data, out, EPOCHS_HELD, **params) | {"model_def": paced_tally(tmp_path, hold)}
    master = start_train(kubeconfig, namespace, log, env, **params)
    try:
        try:
            steps(master, log)
        except AssertionError as e:
            state = diagnose() if diagnose else ""
            raise AssertionError(f"{e}\n{state}\n--- the master's log, last lines:\n{log.read_text()[-6000:]}") from e
        assert master.poll() is None, f"the job ended before the test's last step\n{log.read_text()[-4000:]}"
        hold.unlink()
        master.wait(timeout=400)
    finally:
        if master.poll() is None:
            master.kill()
    text = log.read_text()
    assert master.returncode == 0, text[-4000:]
    return json.loads((out / "summary.json").read_text()), text, out


def share_with_pods(path: Path, writable: bool = False) -> Path:
    """Let any user (the image's, 1000) read ``path``, a temporary directory pytest made for the owner alone, or
    write it too: the directory and the ones above it up to the session's base directory."""
    path.chmod(0o777 if writable else 0o755)
    for parent in path.parents:
        parent.chmod(parent.stat().st_mode | 0o055)
        if parent.name.startswith("pytest-"):  # the session's base directory: the containers see it, not above
            break
    return path
