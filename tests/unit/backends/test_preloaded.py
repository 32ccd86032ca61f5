"""The preloader (backends/preloaded.py) with real processes: an instance forked from it is a process
of its own, with only its own environment, its own session, log and exit status, and TensorFlow already
imported; it dies with the preloader, which dies with the master."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from elastic_step.backends.api import EventKind, InstanceId, InstanceSpec
from elastic_step.backends.local import LocalBackend
from elastic_step.backends.preloaded import Preloader
from elastic_step.instance.api import TOKEN_ENV


def program(action: str) -> list[str]:
    return [sys.executable, "-m", "tests.unit.backends.instance_program", action]


def first_line(log, timeout: float = 60.0) -> dict:
    """What the program reported at its start (`timeout`: a safety limit, not a speed requirement)."""
    deadline = time.monotonic() + timeout
    while not log.exists() or not log.read_text().strip():
        assert time.monotonic() < deadline, "the instance never started"
        time.sleep(0.02)
    return json.loads(log.read_text().splitlines()[0])


def gone(pid: int, timeout: float = 30.0) -> bool:
    """Dead: no such process, or a zombie its new parent has not reaped yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def preloader(tmp_path_factory):
    p = Preloader(tmp_path_factory.mktemp("preloader") / "preloader.log")
    yield p
    p.close()


def test_an_instance_is_its_own_process_with_only_its_own_environment(preloader, tmp_path):
    log = tmp_path / "instance.log"
    child = preloader.start(program("exit:5"), {"INSTANCE_PROGRAM": "mine", "PATH": os.environ["PATH"]}, log)
    assert child.wait(60) == 5 and child.poll() == 5
    seen = first_line(log)
    assert seen["pid"] == child.pid and seen["sid"] == child.pid  # a session of its own
    assert seen["argv"][0].endswith("instance_program.py") and seen["argv"][1:] == ["exit:5"]
    assert seen["env"] == "mine" and seen["env_size"] == 3  # PATH, its own, the parent pid
    assert seen["tensorflow_preloaded"]  # imported once, before the fork


def test_an_uncaught_exception_is_exit_1_with_its_traceback_in_the_log(preloader, tmp_path):
    log = tmp_path / "instance.log"
    child = preloader.start(program("raise"), {}, log)
    assert child.wait(60) == 1
    assert "ValueError: the instance's own error" in log.read_text()


def test_a_killed_instance_ends_with_the_signal(preloader, tmp_path):
    log = tmp_path / "instance.log"
    child = preloader.start(program("sleep"), {}, log)
    first_line(log)
    child.send_signal(signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL


def test_instances_die_with_the_preloader(tmp_path):
    doomed = Preloader(tmp_path / "preloader.log")
    child = doomed.start(program("sleep"), {}, tmp_path / "instance.log")
    first_line(tmp_path / "instance.log")
    os.kill(doomed._proc.pid, signal.SIGKILL)  # as the master's death kills it (PR_SET_PDEATHSIG)
    assert child.wait(30) == -signal.SIGKILL  # reported as lost at once
    assert gone(child.pid), "the instance outlived its preloader"


def test_the_local_backend_forks_the_packages_instances_and_runs_others_as_they_are(tmp_path):
    backend = LocalBackend(tmp_path / "logs", env={TOKEN_ENV: "t"}, preload=True)
    try:
        w0, w1 = InstanceId("worker", 0), InstanceId("worker", 1)
        # a worker whose master never answers: it keeps asking until it is killed
        backend.start(
            InstanceSpec(
                w0,
                [
                    sys.executable,
                    "-m",
                    "elastic_step.worker",
                    "--master",
                    "127.0.0.1:9",
                    "--index",
                    "0",
                    "--model-def",
                    "none.py",
                    "--num-ps",
                    "0",
                ],
            )
        )
        backend.start(InstanceSpec(w1, [sys.executable, "-c", "import os; print(os.getppid())"]))
        with open(f"/proc/{backend.pid(w0)}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == backend._preloader._proc.pid
        backend.kill(w0)
        ends = {}
        deadline = time.monotonic() + 60
        while len(ends) < 2 and time.monotonic() < deadline:
            for ev in backend.events(timeout=0.2):
                if ev.kind in (EventKind.EXITED, EventKind.LOST):
                    ends[ev.instance] = (ev.kind, ev.exit_code)
        assert ends == {w0: (EventKind.LOST, -9), w1: (EventKind.EXITED, 0)}
        assert backend.log_path(w1).read_text().strip() == str(os.getpid())  # a plain child of the master
    finally:
        backend.close(grace_s=2)


def test_the_preloader_exits_by_itself_when_its_pipe_closes(preloader):
    """Last in this module: it ends the module's preloader. EOF is what a dead master leaves."""
    preloader._proc.stdin.close()
    assert preloader._proc.wait(30) == 0


def run_master(tmp_path, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.backends.forking_master", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_master_with_one_thread_forks_its_preloader_from_itself(tmp_path):
    seen = run_master(tmp_path)
    assert seen["forked"] and seen["code"] == 3
    # not a fresh interpreter: the master's own command line, in a process of the master's
    assert seen["preloader_cmdline"][1:] == ["-m", "tests.unit.backends.forking_master"]
    first = first_line(tmp_path / "instance.log")
    assert first["ppid"] == seen["preloader"] and first["tensorflow_preloaded"]
    assert first["env"] == "mine" and first["env_size"] == 3  # only its own environment
    assert first["logging_handlers"] == 0  # the master's logging stayed the master's
    assert "the master's own line" not in (tmp_path / "instance.log").read_text()  # nor its buffered output
    assert seen["preloader_stderr"] == str(tmp_path / "preloader.log")  # its own log, as named
    assert gone(seen["preloader"]), "the forked preloader outlived its master"


def test_a_master_already_running_threads_starts_a_fresh_preloader(tmp_path):
    seen = run_master(tmp_path, "thread")
    assert not seen["forked"] and seen["code"] == 3
    assert seen["preloader_cmdline"][1:] == ["-m", "elastic_step.backends.preloaded"]
    assert first_line(tmp_path / "instance.log")["tensorflow_preloaded"]
    assert gone(seen["preloader"])
