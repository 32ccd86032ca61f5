"""Containers of the project's own programs forked from an interpreter that has imported TensorFlow once.

Each pod's worker, PS or master would otherwise be a fresh interpreter importing TensorFlow and Keras: about 5 s
of CPU a container, on the 2 cores the suite shares. The local backend's preloader (elastic_step/backends/
preloaded.py) forks its instances for the same reason; here the fork must land in the container's own mount and
PID namespaces, which are made before the command runs (mounts.py). So the container's command becomes this
module's small *client* (zygote_client.py: the standard library only, started in milliseconds), and the client
asks the *zygote*, one process per test process, over an abstract Unix socket:

- the zygote forks a *keeper*, which enters the client's mount and PID namespaces (found from the socket's
  peer credentials), and forks the *instance* there: a process of the container's PID namespace, in its own
  session, with the client's standard input, output and error (passed over the socket), working directory and
  environment, running `python -m MODULE ARGS` (the product's run_as_main, as the preloader's instances do);
- the client passes on the SIGTERM or SIGINT the container's init sends it, and ends as the instance ended (its
  exit code, or the same signal), so the kubelet reads the status a fresh interpreter would have left;
- what ends a container ends the instance: its PID namespace's end kills every process in it, the instance
  included, and the keeper kills the instance when the client is gone.

A freeze finds the instance among the container's processes (its PID namespace). Only `python -m elastic_step.*`
with this interpreter is forked (backends/preloaded.py's `preloadable`), and only as root (a container with a
user namespace of its own would need the keeper in it too); anything else runs as it is.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
from pathlib import Path

CLIENT = Path(__file__).with_name("zygote_client.py")

_lock = threading.Lock()
_zygote: tuple[subprocess.Popen, str] | None = None  # this test process's zygote, and its socket's name
_alive_w: list[int] = []  # pipes' write ends, open for this test process's life: their EOF ends its zygotes


def client_argv(argv: list[str], map_root_user: bool) -> list[str]:
    """The container command that runs `argv` forked from the zygote, or `argv` itself when it cannot be."""
    from elastic_step.backends.preloaded import preloadable

    if map_root_user or not preloadable(argv) or os.environ.get("ELASTIC_STEP_KUBELET_ZYGOTE") == "0":
        return argv
    return [sys.executable, "-I", "-S", str(CLIENT), _started(), "--", *argv]


def _started() -> str:
    """The zygote's socket name, the zygote started once per test process (it imports for seconds: a client that
    connects meanwhile waits in the socket's backlog)."""
    global _zygote
    with _lock:
        if _zygote is None or _zygote[0].poll() is not None:
            name = f"elastic-step-zygote-{os.getpid()}-{secrets.token_hex(4)}"
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind("\0" + name)
            listener.listen(128)
            alive_r, alive_w = os.pipe()  # EOF tells the zygote that this process is gone
            proc = subprocess.Popen(
                [sys.executable, __file__, str(listener.fileno()), str(alive_r)],
                pass_fds=(listener.fileno(), alive_r),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            listener.close()
            os.close(alive_r)
            atexit.register(proc.kill)
            _zygote = (proc, name)
            _alive_w.append(alive_w)
        return _zygote[1]


# --------------------------------------------------------------------------------------------- the zygote
def _serve(listener: socket.socket, alive: int) -> None:
    import importlib
    import selectors
    import signal

    from elastic_step.backends.preloaded import PRELOAD
    from elastic_step.util.process import quiet_tensorflow

    quiet_tensorflow()
    for name in PRELOAD:
        importlib.import_module(name)
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
    pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    for kind, nstype in (("pid", CLONE_NEWPID), ("mnt", CLONE_NEWNS)):
        ns = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY)
        _setns(ns, nstype)
        os.close(ns)
    child = os.fork()  # in the container's PID namespace
    if child == 0:
        _instance(req, fds, conn)
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
                os.kill(child, 9)
                selector.unregister(conn)
                continue
            pending += more
            *lines, pending = pending.split(b"\n")
            for line in lines:
                os.kill(child, json.loads(line)["signal"])


def _instance(req: dict, fds: list[int], conn: socket.socket) -> None:
    from elastic_step.backends.preloaded import run_as_main

    os.setsid()
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
