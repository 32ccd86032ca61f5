"""The local backend against the Backend contract, with real subprocesses: every end of an
instance is an event from the process's own end (no polling, no timeout), with how it ended."""

from __future__ import annotations

import os
import sys
import time

import pytest

from elastic_step.backends.api import EventKind, InstanceId, InstanceSpec
from elastic_step.backends.local import LocalBackend

W0 = InstanceId("worker", 0)


def spec(code: str, inst: InstanceId = W0) -> InstanceSpec:
    return InstanceSpec(inst, [sys.executable, "-c", code])


# Printed once the program's signal handlers are in place, never before.
READY = "print('ready', flush=True)\n"


def next_end(backend: LocalBackend, timeout: float = 20.0):
    """The next EXITED or LOST event (`timeout`: a safety limit, not a speed requirement)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in backend.events(timeout=0.2):
            if ev.kind in (EventKind.EXITED, EventKind.LOST):
                return ev
    pytest.fail("no end event")


def wait_ready(backend: LocalBackend, inst: InstanceId = W0) -> None:
    """Until the instance's program runs (its signal handlers are in place): it printed READY."""
    deadline = time.monotonic() + 20.0
    while "ready" not in backend.log_path(inst).read_text():
        assert time.monotonic() < deadline, f"{inst} never got ready"
        time.sleep(0.02)


@pytest.fixture
def backend(tmp_path):
    b = LocalBackend(tmp_path / "logs", env={"ELASTIC_STEP_TEST": "yes"})
    yield b
    b.close(grace_s=2)


def test_exit_code_is_reported(backend):
    backend.start(spec("import sys; sys.exit(3)"))
    ev = next_end(backend)
    assert (ev.kind, ev.instance, ev.exit_code) == (EventKind.EXITED, W0, 3)


def test_sigkill_is_a_loss_reported_from_the_reaped_process(backend):
    """The loss comes from the process's end itself (the signal that killed it, as the kernel
    reports it when the child is reaped), once, with no further call into the backend."""
    backend.start(spec(READY + "import time; time.sleep(60)"))
    wait_ready(backend)
    pid = backend.pid(W0)
    backend.kill(W0)
    ev = next_end(backend)
    assert (ev.kind, ev.instance, ev.exit_code, ev.detail) == (EventKind.LOST, W0, -9, "killed by SIGKILL")
    assert W0 not in backend.alive() and backend.pid(W0) is None
    with pytest.raises(ChildProcessError):  # already reaped, by the thread that reported it
        os.waitpid(pid, os.WNOHANG)
    assert [e.kind for e in backend.events(timeout=0.2)] == []  # one loss, not one per poll


def test_stop_is_graceful_then_forced(backend, tmp_path):
    marker = tmp_path / "termed"
    backend.start(
        spec(
            f"import signal, sys, time\n"
            f"signal.signal(signal.SIGTERM, lambda *a: (open({str(marker)!r}, 'w').close(), sys.exit(0)))\n"
            + READY
            + "time.sleep(60)"
        )
    )
    wait_ready(backend)
    backend.stop(W0, grace_s=5)
    ev = next_end(backend)
    assert (ev.kind, ev.exit_code) == (EventKind.EXITED, 0)
    assert marker.exists()
    stubborn = InstanceId("worker", 1)
    backend.start(
        spec(
            "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + READY + "time.sleep(60)", stubborn
        )
    )
    wait_ready(backend, stubborn)
    backend.stop(stubborn, grace_s=0.5)
    ev = next_end(backend)
    # SIGTERM was ignored: the end came from the SIGKILL after the grace period
    assert (ev.instance, ev.kind, ev.detail) == (stubborn, EventKind.LOST, "killed by SIGKILL")


def test_env_and_logs_and_relaunch(backend):
    backend.start(spec("import os; print('env', os.environ['ELASTIC_STEP_TEST'])"))
    next_end(backend)
    assert "env yes" in backend.log_path(W0).read_text()
    backend.start(spec("print('second launch')"))  # the same instance, relaunched
    next_end(backend)
    assert "second launch" in backend.log_path(W0).read_text()
    assert backend.log_path(W0).name.endswith(".2.log")


def test_close_stops_everyone_gracefully(backend):
    insts = [InstanceId("worker", i) for i in range(3)]
    for inst in insts:
        backend.start(spec(READY + "import time; time.sleep(60)", inst))
    for inst in insts:
        wait_ready(backend, inst)
    assert backend.alive() == set(insts)
    backend.close(grace_s=2)
    assert backend.alive() == set()
    ends = {}
    while len(ends) < 3:
        ev = next_end(backend)
        ends[ev.instance] = ev.detail
    assert ends == dict.fromkeys(insts, "killed by SIGTERM")  # asked to go, never forced
