"""Local instances forked from an interpreter that has already imported TensorFlow.

Importing TensorFlow and Keras costs a worker or PS process about 5-6 s of CPU at every launch: at the
job's start and again at every relaunch after a loss, on cores the running workers need. Every instance
of the local backend runs this package's code, so a *preloader* (one process per backend) imports it
once and forks each instance from itself: an instance runs its own code a few milliseconds after the
master asks. The fork happens before TensorFlow creates its runtime (its thread pools come with the first
op, and nothing in the preloader runs one), and the preloader's Python code runs in one thread (a signal
wakes its loop through a pipe): that is what makes forking it safe.

Each instance is still a process of its own: its own session, environment, log file and exit status,
reported the moment the preloader reaps it. It dies with the master as before: the preloader exits when
the master's end of its pipe closes (and is killed with it, PR_SET_PDEATHSIG), and each instance dies
with the preloader (util/process.py's die_with_parent, through PARENT_ENV).

The master imports TensorFlow too (its evaluation, its checkpoints). So a master that will run its instances
here forks its preloader from itself once it has imported the same modules, at the start of the job, while it
still runs one thread and before TensorFlow's runtime exists (fork_preloader): TensorFlow is then imported
once per job, not twice (about 5 s of CPU, at the start, on the cores the job's first steps want). Elsewhere
(a master already running threads, a job started from a larger program) the preloader is a fresh interpreter
as before.

Protocol, one JSON object per line: the master writes {"log"} first (the preloader's own log), then
{"id", "module", "args", "env", "log"} per instance; the preloader answers {"id", "pid"} at the fork and
{"pid", "returncode"} when that child ends.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import NoReturn

from elastic_step.util.process import PARENT_ENV

# What every worker and PS imports before its first line of work.
PRELOAD = (
    "tensorflow",
    "keras",
    "numpy",
    "grpc",
    "elastic_step.instance.startup",
    "elastic_step.instance.master_client",
    "elastic_step.model_def",
)


def preloadable(argv: list[str]) -> bool:
    """`python -m elastic_step.<module> ...`: this package's code, which the preloader has imported."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2].startswith("elastic_step.")


class PreloadedProcess:
    """The part of subprocess.Popen the local backend uses, for an instance the preloader forked."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _end(self, returncode: int) -> None:
        self.returncode = returncode
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)


class ForkedPreloader:
    """The part of subprocess.Popen the Preloader uses, for a preloader this process forked from itself."""

    def __init__(self, pid: int, requests: int, replies: int):
        self.pid = pid
        self.stdin = os.fdopen(requests, "wb")
        self.stdout = os.fdopen(replies, "rb")
        self.returncode: int | None = None
        self._lock = threading.Lock()  # one reaper

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


_forked: ForkedPreloader | None = None  # forked by fork_preloader, for the next Preloader


def fork_preloader() -> bool:
    """Fork this process's preloader now, for the next Preloader to take, if that is safe: after importing
    PRELOAD, this process runs one thread and TensorFlow's runtime has not started (what makes the preloader's
    own forks safe). For a master whose instances are local: it imports TensorFlow anyway. Whether one waits."""
    global _forked
    if _forked is not None or not sys.platform.startswith("linux") or threading.active_count() != 1:
        return _forked is not None
    preload()
    from tensorflow.python.eager import context

    if threading.active_count() != 1 or context.context_safe() is not None:
        return False
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    sys.stdout.flush()  # else a child would write what this process had buffered
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the preloader: as if started as `python -m elastic_step.backends.preloaded`
        code = 1
        try:
            os.setsid()
            os.close(requests_w)
            os.close(replies_r)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # until the Preloader names the log
                os.dup2(null, fd)
            os.close(null)
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            logging.root.handlers.clear()  # an instance configures its own logging
            logging.root.setLevel(logging.WARNING)
            os.environ[PARENT_ENV] = str(parent)  # it dies with this process, as a started one does
            _serve(requests_r, replies_w)
            code = 0
        finally:
            os._exit(code)  # never the parent's code after the fork
    os.close(requests_r)
    os.close(replies_w)
    _forked = ForkedPreloader(pid, requests_w, replies_r)
    return True


class Preloader:
    """The master's side: forks instances through the preloader, the one this process forked from itself
    (fork_preloader) or else one started at once as a fresh interpreter (its imports overlapping the master's
    own start-up)."""

    def __init__(self, log_path: str | os.PathLike):
        global _forked
        self._log = open(log_path, "ab")
        if _forked is not None and _forked.poll() is None:
            self._proc, _forked = _forked, None
        else:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "elastic_step.backends.preloaded"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                env={**os.environ, PARENT_ENV: str(os.getpid())},
                start_new_session=True,
            )
        self._proc.stdin.write(json.dumps({"log": str(log_path)}).encode() + b"\n")
        self._proc.stdin.flush()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._forked: dict[int, list] = {}  # request id -> [event, pid]
        self._children: dict[int, PreloadedProcess] = {}
        threading.Thread(target=self._read, daemon=True, name="preloader").start()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def start(
        self, argv: list[str], env: dict[str, str], log_path: str | os.PathLike, timeout: float = 300.0
    ) -> PreloadedProcess:
        """Fork `python -m MODULE ARGS` with `env` (its whole environment), output to `log_path`.
        The first call waits for the preloader's imports (seconds)."""
        rid = next(self._ids)
        forked = [threading.Event(), None]
        with self._lock:
            self._forked[rid] = forked
            self._proc.stdin.write(
                json.dumps({"id": rid, "module": argv[2], "args": argv[3:], "env": env, "log": str(log_path)}).encode()
                + b"\n"
            )
            self._proc.stdin.flush()
        if not forked[0].wait(timeout) or forked[1] is None:
            raise RuntimeError(f"the local backend's preloader did not start {argv[2]} (see {self._log.name})")
        return self._children[forked[1]]

    def _read(self) -> None:
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._lock:
                if "id" in msg:
                    child = PreloadedProcess(msg["pid"])
                    self._children[child.pid] = child
                    forked = self._forked.pop(msg["id"])
                    forked[1] = child.pid
                    forked[0].set()
                else:
                    child = self._children.pop(msg["pid"], None)
                    if child is not None:
                        child._end(msg["returncode"])
        # The preloader is gone (killed): its children die with it (PR_SET_PDEATHSIG).
        with self._lock:
            for child in self._children.values():
                child._end(-9)
            self._children.clear()
            for forked in self._forked.values():
                forked[0].set()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()  # EOF: the preloader exits
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._log.close()


# ---------------------------------------------------------------------------------- the preloader itself
def preload() -> None:
    """Import PRELOAD, TensorFlow's C++ log quieted first: what a process does before it forks instances."""
    import importlib

    from elastic_step.util.process import quiet_tensorflow

    quiet_tensorflow()
    for name in PRELOAD:
        importlib.import_module(name)


def _main() -> None:
    """`python -m elastic_step.backends.preloaded`: the preloader as a fresh interpreter."""
    preload()
    _serve(sys.stdin.buffer.raw.fileno(), os.dup(sys.stdout.fileno()))


def _serve(requests: int, replies: int) -> None:
    """The preloader's loop, PRELOAD imported: requests from the master on `requests`, replies on `replies`."""
    import selectors

    from elastic_step.util.process import die_with_parent

    die_with_parent()
    # SIGCHLD wakes the loop through a pipe, so the loop stays single-threaded: fork needs that.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)

    def reply(msg: dict) -> None:
        os.write(replies, json.dumps(msg).encode() + b"\n")

    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fd == wake_r:
                os.read(wake_r, 4096)
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    reply({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})
                continue
            data = os.read(requests, 1 << 16)
            if not data:
                return  # the master is gone, or closed the backend
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                req = json.loads(line)
                if "id" not in req:  # the preloader's own log
                    log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                    os.dup2(log, 2)
                    os.close(log)
                    continue
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (requests, replies, wake_r, wake_w):
                        if fd > 2:  # stdin (a started preloader's requests) is replaced below
                            os.close(fd)
                    _run_instance(req)
                reply({"id": req["id"], "pid": pid})


def _run_instance(req: dict) -> NoReturn:
    """In the forked child: become the instance `python -m MODULE ARGS` would have been, then exit."""
    from elastic_step.util.process import die_with_parent

    os.setsid()
    log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(req["env"])
    os.environ[PARENT_ENV] = str(os.getppid())  # the preloader, which dies with the master
    die_with_parent()
    run_as_main(req["module"], req["args"])


def run_as_main(module: str, args: list[str]) -> NoReturn:
    """In a forked child: run `module` as `python -m MODULE ARGS` would, then end the process with the exit
    status that would have had."""
    import runpy
    import traceback

    from elastic_step.util.process import exit_before_native_teardown

    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    exit_before_native_teardown(code, join_threads=False)  # as an instance always ended: its threads not waited for


if __name__ == "__main__":
    _main()
