"""The step's health endpoint on a real local job (real worker and PS processes, real TensorFlow).

In this process, so that the test holds the master's pump at its hook point: the endpoint answers 200 while
the job trains, 503 with the reason while the pump is held (the job's other threads going on), 200 again once
it turns, and the held pump costs the job nothing (the tally's weights exact). Through the real CLI
(`--health-port`), a master frozen whole (SIGSTOP) does not answer at all, which a probe counts as a failure
too, and answers again once resumed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from elastic_step import fault_hooks
from elastic_step.master import health
from elastic_step.master.api import TrainConfig
from elastic_step.master.job import train
from elastic_step.spec import cli_args
from tests.integration.harness import ROOT, SMALL_LEASES
from tests.models.witness import TALLY_MODEL, assert_each_record_applied_exactly, assert_exactly_once

pytestmark = pytest.mark.slow

BOUND_S = 1.0  # the pump's bound in this test: a held pump is reported soon


def get(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{health.PATH}", timeout=10) as r:
            return r.status, r.read().decode().strip()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode().strip()


class HoldThePump:
    """At PUMP_TURN: once training has committed records, ask the endpoint; at the next turn, hold the pump
    until the endpoint reports it (or give up after `patience` s: the test then fails on what it saw); at the
    turn after, ask again."""

    def __init__(self, port: int, patience: float = 60.0):
        self.port, self.patience = port, patience
        self.answers: dict[str, tuple[int, str]] = {}

    def __call__(self, committed: int) -> None:
        if committed == 0 or "after" in self.answers:
            return
        phase = next(p for p in ("training", "held", "after") if p not in self.answers)
        answer = get(self.port)
        if phase == "held":
            given_up = time.monotonic() + self.patience
            while answer[0] == 200 and time.monotonic() < given_up:
                time.sleep(0.2)
                answer = get(self.port)
        self.answers[phase] = answer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


EPOCHS = 30  # about 5 s of training here: it outlasts the held pump (about 1 s), so the pump turns again


def test_a_training_job_answers_healthz_and_a_held_pump_answers_503(tally_data, tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setattr(health, "PUMP_BOUND_S", BOUND_S)
    hold = HoldThePump(port)
    fault_hooks.PUMP_TURN.install(hold)
    try:
        cfg = TrainConfig(
            model_def=TALLY_MODEL,
            train_data=tally_data["train"],
            eval_data=tally_data["eval"],
            output=str(tmp_path),
            epochs=EPOCHS,
            max_workers=2,
            backend="local",
            progress="off",
            health_port=port,
            **SMALL_LEASES,
        )
        summary = train(cfg)
    finally:
        fault_hooks.PUMP_TURN.install(None)
    assert set(hold.answers) == {"training", "held", "after"}, f"the pump was never held: {hold.answers}"
    status, text = hold.answers["training"]
    assert status == 200 and text.startswith("ok: the master's pump turned"), hold.answers
    status, text = hold.answers["held"]
    assert status == 503 and text.startswith("the master's pump has not turned for"), hold.answers
    assert text.endswith(f"(bound {BOUND_S:.0f} s)"), text
    assert hold.answers["after"][0] == 200, hold.answers
    assert_exactly_once(summary)
    assert_each_record_applied_exactly(tmp_path, tally_data, EPOCHS)
    with pytest.raises(urllib.error.URLError):  # served for the step's length, not after it
        get(port)


def test_a_frozen_master_does_not_answer_until_it_is_resumed(tally_data, tmp_path):
    port = free_port()
    data = {"model_def": TALLY_MODEL, "train_data": tally_data["train"], "eval_data": tally_data["eval"]}
    argv = cli_args(
        **data, output=tmp_path, epochs=4, max_workers=1, backend="local", progress="lines", health_port=port
    )
    with open(tmp_path / "stderr.log", "w") as err:
        master = subprocess.Popen(
            [sys.executable, "-m", "elastic_step.cli", "train", *argv], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err
        )
    try:
        answer = (0, "")
        for _ in range(600):  # until the pump turns, or the master ends (the test fails below)
            try:
                answer = get(port)
            except (urllib.error.URLError, OSError):
                pass
            if answer[1].startswith("ok: ") or master.poll() is not None:
                break
            time.sleep(0.2)
        assert answer[0] == 200 and answer[1].startswith("ok: "), (answer, (tmp_path / "stderr.log").read_text())
        os.kill(master.pid, signal.SIGSTOP)
        try:
            with pytest.raises(OSError):  # a timeout or a refusal: no answer, which a probe counts as a failure
                urllib.request.urlopen(f"http://127.0.0.1:{port}{health.PATH}", timeout=2).read()
        finally:
            os.kill(master.pid, signal.SIGCONT)
        assert get(port)[0] == 200
        assert master.wait(timeout=600) == 0, (tmp_path / "stderr.log").read_text()[-3000:]
    finally:
        if master.poll() is None:
            master.kill()
            master.wait()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert_exactly_once(summary)
    assert_each_record_applied_exactly(tmp_path, tally_data, 4)
