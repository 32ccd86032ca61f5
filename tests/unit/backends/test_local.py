"""The local backend against the Backend contract, with real subprocesses: every end of an
instance is an event at once (no polling, no timeout), with how it ended."""
from __future__ import annotations

import sys
import time

import pytest

from elastic_step.backends.api import EventKind, InstanceId, InstanceSpec
from elastic_step.backends.local import LocalBackend

W0 = InstanceId("worker", 0)


def spec(code: str, inst: InstanceId = W0) -> InstanceSpec:
    return InstanceSpec(inst, [sys.executable, "-c", code])


def next_end(backend: LocalBackend, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in backend.events(timeout=0.2):
            if ev.kind in (EventKind.EXITED, EventKind.LOST):
                return ev, time.monotonic()
    pytest.fail("no end event")


@pytest.fixture
def backend(tmp_path):
    b = LocalBackend(tmp_path / "logs", env={"ELASTIC_STEP_TEST": "yes"})
    yield b
    b.close(grace_s=2)


def test_exit_code_is_reported(backend):
    backend.start(spec("import sys; sys.exit(3)"))
    ev, _ = next_end(backend)
    assert (ev.kind, ev.instance, ev.exit_code) == (EventKind.EXITED, W0, 3)


def test_sigkill_is_a_loss_reported_at_once(backend):
    backend.start(spec("import time; time.sleep(60)"))
    time.sleep(0.3)
    t0 = time.monotonic()
    backend.kill(W0)
    ev, t1 = next_end(backend)
    assert ev.kind == EventKind.LOST and "SIGKILL" in ev.detail
    assert t1 - t0 < 1.0
    assert W0 not in backend.alive()


def test_stop_is_graceful_then_forced(backend, tmp_path):
    marker = tmp_path / "termed"
    backend.start(spec(f"import signal, sys, time\n"
                       f"signal.signal(signal.SIGTERM, lambda *a: (open({str(marker)!r}, 'w').close(), sys.exit(0)))\n"
                       f"time.sleep(60)"))
    time.sleep(0.5)
    backend.stop(W0, grace_s=5)
    ev, _ = next_end(backend)
    assert (ev.kind, ev.exit_code) == (EventKind.EXITED, 0)
    assert marker.exists()
    stubborn = InstanceId("worker", 1)
    backend.start(spec("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)",
                       stubborn))
    time.sleep(0.5)
    backend.stop(stubborn, grace_s=0.5)
    ev, _ = next_end(backend)
    assert ev.instance == stubborn and ev.kind == EventKind.LOST


def test_env_and_logs_and_relaunch(backend):
    backend.start(spec("import os; print('env', os.environ['ELASTIC_STEP_TEST'])"))
    next_end(backend)
    assert "env yes" in backend.log_path(W0).read_text()
    backend.start(spec("print('second launch')"))   # the same instance, relaunched
    next_end(backend)
    assert "second launch" in backend.log_path(W0).read_text()
    assert backend.log_path(W0).name.endswith(".2.log")


def test_close_stops_everyone(backend):
    for i in range(3):
        backend.start(spec("import time; time.sleep(60)", InstanceId("worker", i)))
    time.sleep(0.3)
    assert len(backend.alive()) == 3
    backend.close(grace_s=2)
    assert backend.alive() == set()
