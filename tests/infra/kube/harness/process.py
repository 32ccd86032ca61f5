"""What every part of the harness shares: starting, stopping and killing child processes, running a
scripts/build-*, polling, free ports. The control plane, the process kubelet's pods, Argo's controller and
the gang scheduler all import it, and it imports none of them."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
KUBE = REPO / "tests" / "infra" / "kube"  # the Go modules and VERSION files the scripts/build-* build from


class Service:
    """A part of the harness that runs for a `with` block: `start()` (which returns it) on entry, `stop()`
    on exit."""

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_build(
    script: Path, *args: str, override_env: str, error: type[Exception] = RuntimeError, env: dict | None = None
) -> Path:
    """The bin directory a scripts/build-* prints last on stdout (each is a no-op when its binaries
    exist; its progress goes to our stderr), or `override_env`'s directory when that is set."""
    override = os.environ.get(override_env)
    if override:
        return Path(override)
    proc = subprocess.run(
        [str(script), *args], stdout=subprocess.PIPE, stderr=None, text=True, env={**os.environ, **(env or {})}
    )
    if proc.returncode != 0:
        raise error(f"{script} failed with exit code {proc.returncode}")
    return Path(proc.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_libc = None
with contextlib.suppress(OSError):
    _libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:  # preexec_fn: SIGKILL the child when its parent thread dies
    if _libc is not None:
        _libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def popen(argv: list[str], *, log_path: Path, env=None, cwd=None) -> subprocess.Popen:
    """Start a child in its own process group, logging to a file; killed if we die."""
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL the whole process group after ``timeout``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def alive(pid: int, since: int | None = None) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a killed process nobody has reaped yet is dead). With
    ``since`` (its ``started``): that very process, not a later one given the same PID (PIDs are reused, soon on a
    busy machine with a small pid_max)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    if since is not None and int(fields[19]) != since:
        return False
    return fields[0] not in ("Z", "X")


def started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot): with its PID, it names one process. None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError):
        return None


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP: state T)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.2, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy; return that value."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def http_ok(url: str, insecure: bool = False) -> bool:
    ctx = None
    if url.startswith("https"):
        ctx = ssl.create_default_context()
        if insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False
