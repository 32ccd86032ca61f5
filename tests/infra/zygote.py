"""The project's programs forked from an interpreter that has imported TensorFlow once, for the test suite.

Each master a test starts, and each pod's worker, PS or master, would otherwise be a fresh interpreter importing
TensorFlow and Keras: about 5 s of CPU each, on the 2 cores the suite shares. The local backend's preloader
(elastic_step/backends/preloaded.py) forks its instances for the same reason. Here one *zygote* per test process
imports them once and, for each request over an abstract Unix socket, forks a *keeper*, which forks the program:

- `run` (tests/integration/harness.py's masters): as `subprocess.run` with captured output, the test process being
  the client: the program gets its argv, environment, working directory, and pipes for its output;
- `client_argv` (the process kubelet's containers): the container's command becomes a small client
  (zygote_client.py: the standard library only, started in milliseconds), whose namespaces the keeper enters (found
  from the socket's peer credentials) before it forks the program: a process of the container's PID namespace,
  with the client's standard streams, working directory and environment. The client passes on the SIGTERM or
  SIGINT the container's init sends it, and ends as the program ended (its exit code, or the same signal), so the
  kubelet reads the status a fresh interpreter would have left; the container's end kills every process of its
  PID namespace, the program included, and the keeper kills the program when its client is gone.

In the project's image (tests/infra/kube/harness/oci.py) the zygote is this file run by the image's Python inside
the image under runc, and the client the image's Python too: the program is forked with the client's user, groups
and no_new_privs, so it runs as the container's user, on the image's code, in the container's root and volumes.

The program runs in a session of its own, as `python -m MODULE ARGS` (the product's run_as_main, as the preloader's
instances do). Only `python -m elastic_step.*` with this interpreter is forked (backends/preloaded.py's
`preloadable`), and in a container only as root (one with a user namespace of its own would need the keeper in
it too); anything else runs as it is, and so does everything with ELASTIC_STEP_TEST_ZYGOTE=0.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

CLIENT = Path(__file__).with_name("zygote_client.py")

_lock = threading.Lock()
# this test process's zygotes, by what they run in ("" for this interpreter; an image's root filesystem), each with
# its socket's name
_zygotes: dict[str, tuple[subprocess.Popen, str]] = {}
_alive_w: list[int] = []  # pipes' write ends, open for this test process's life: their EOF ends its zygotes


def forks(argv: list[str]) -> bool:
    """Whether `argv` is a program the zygote forks."""
    from elastic_step.backends.preloaded import preloadable

    return preloadable(argv) and os.environ.get("ELASTIC_STEP_TEST_ZYGOTE") != "0"


def client_argv(argv: list[str], map_root_user: bool) -> list[str]:
    """The container command that runs `argv` forked from the zygote, or `argv` itself when it cannot be."""
    if map_root_user or not forks(argv):
        return argv
    return [sys.executable, "-I", "-S", str(CLIENT), _started(), "--", *argv]


def run(argv: list[str], *, cwd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout)`, the program
    forked from the zygote when it forks it."""
    if not forks(argv):
        return subprocess.run(argv, cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout)
    import selectors
    import time

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect("\0" + _started())
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    request = {"argv": argv, "env": env, "cwd": cwd}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [null, out_w, err_w])
    for fd in (null, out_w, err_w):
        os.close(fd)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    selector = selectors.DefaultSelector()
    for fd in (out_r, err_r, conn.fileno()):
        selector.register(fd, selectors.EVENT_READ)
    replies, pid, code = b"", None, None
    deadline = time.monotonic() + timeout
    try:
        while len(selector.get_map()) > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                if pid is not None:
                    # The keeper may have reaped it at the deadline; closing the socket (below) kills it anyway.
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(argv, timeout)
            for key, _ in selector.select(left):
                if key.fd == conn.fileno():
                    more = conn.recv(4096)
                    if not more:
                        selector.unregister(conn)
                        continue
                    msgs, replies = _messages(replies + more)
                    for msg in msgs:
                        pid = msg.get("pid", pid)
                        code = msg.get("exit", code)
                    continue
                data = os.read(key.fd, 1 << 16)
                if data:
                    chunks[key.fd].append(data)
                else:
                    selector.unregister(key.fd)
    finally:
        selector.close()
        conn.close()
        os.close(out_r)
        os.close(err_r)
    if code is None:
        raise RuntimeError(f"the zygote's keeper ended without the status of {argv}")
    out, err = (b"".join(chunks[fd]).decode(errors="replace") for fd in (out_r, err_r))
    return subprocess.CompletedProcess(argv, code, out, err)


def _started(key: str = "", command: Callable[[int, int], list[str]] | None = None) -> str:
    """The socket name of the zygote `key`, started once per test process (it imports for seconds: a client that
    connects meanwhile waits in the socket's backlog). `command(listener, alive)`, when given, is the zygote's
    command line, which hands it the two descriptors as 3 and 4 (an image's zygote: oci.py); by default it is this
    interpreter running this file."""
    with _lock:
        if key not in _zygotes or _zygotes[key][0].poll() is not None:
            name = f"elastic-step-zygote-{os.getpid()}-{secrets.token_hex(4)}"
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind("\0" + name)
            listener.listen(128)
            alive_r, alive_w = os.pipe()  # EOF tells the zygote that this process is gone
            argv = [sys.executable, __file__, str(listener.fileno()), str(alive_r)]
            proc = subprocess.Popen(
                argv if command is None else command(listener.fileno(), alive_r),
                pass_fds=(listener.fileno(), alive_r),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            listener.close()
            os.close(alive_r)
            atexit.register(proc.kill)
            _zygotes[key] = (proc, name)
            _alive_w.append(alive_w)
        return _zygotes[key][1]


# --------------------------------------------------------------------------------------------- the zygote
def _serve(listener: socket.socket, alive: int) -> None:
    import selectors

    from elastic_step.backends.preloaded import preload

    preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # keepers are reaped by the kernel
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(alive, selectors.EVENT_READ)
    while True:  # one thread: what makes the forks safe
        for key, _ in selector.select():
            if key.fd == alive:
                return  # the test process is gone
            conn, _ = listener.accept()
            if os.fork() == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                listener.close()
                os.close(alive)
                code = 1
                try:
                    _keep(conn)
                    code = 0
                finally:
                    os._exit(code)
            conn.close()


def _setns(fd: int, nstype: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, nstype) != 0:
        raise OSError(ctypes.get_errno(), f"setns({nstype:#x})")


def _keep(conn: socket.socket) -> None:
    """The keeper: the instance forked in the client's namespaces, its signals passed on, its end reported."""
    import selectors
    import struct

    CLONE_NEWNS, CLONE_NEWPID = 0x00020000, 0x20000000
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            return
        data += more
    req = json.loads(data)
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    creds = _credentials(pid, uid, gid)  # read before entering the namespaces: /proc is this zygote's until then
    for kind, nstype in (("pid", CLONE_NEWPID), ("mnt", CLONE_NEWNS)):
        if os.readlink(f"/proc/{pid}/ns/{kind}") != os.readlink(f"/proc/self/ns/{kind}"):  # a container's
            ns = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY)
            _setns(ns, nstype)
            os.close(ns)
    child = os.fork()  # in the client's PID namespace
    if child == 0:
        _instance(req, fds, conn, creds)
    conn.sendall(json.dumps({"pid": child}).encode() + b"\n")
    for fd in fds:
        os.close(fd)
    exited = os.pidfd_open(child)
    selector = selectors.DefaultSelector()
    selector.register(conn, selectors.EVENT_READ)
    selector.register(exited, selectors.EVENT_READ)
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fd == exited:
                _, status = os.waitpid(child, 0)
                with contextlib.suppress(OSError):  # the client may be gone
                    conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                return
            more = conn.recv(4096)
            if not more:  # the client is gone: so is the container
                os.kill(child, signal.SIGKILL)
                selector.unregister(conn)
                continue
            msgs, pending = _messages(pending + more)
            for msg in msgs:
                os.kill(child, msg["signal"])


def _messages(buffer: bytes) -> tuple[list[dict], bytes]:
    """The whole JSON lines at the start of `buffer`, and the partial line after them."""
    *lines, rest = buffer.split(b"\n")
    return [json.loads(line) for line in lines], rest


def _credentials(pid: int, uid: int, gid: int) -> tuple[int, int, list[int], bool]:
    """The client's user, group, supplementary groups and no_new_privs: what the program takes on."""
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return uid, gid, [int(g) for g in status["Groups"].split()], status.get("NoNewPrivs", "0").strip() == "1"


def _instance(req: dict, fds: list[int], conn: socket.socket, creds: tuple[int, int, list[int], bool]) -> NoReturn:
    from elastic_step.backends.preloaded import run_as_main

    os.setsid()
    uid, gid, groups, no_new_privs = creds
    if (uid, gid) != (os.getuid(), os.getgid()):  # a container's user (an image's zygote runs as root)
        os.setgroups(groups)
        os.setgid(gid)
        os.setuid(uid)  # which clears every capability this root process had
    if no_new_privs:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    conn.close()
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    # as `python -m` makes sys.path: the working directory first, then PYTHONPATH
    extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:1] = [os.getcwd(), *extra]
    argv = req["argv"]
    run_as_main(argv[2], argv[3:])


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]))
