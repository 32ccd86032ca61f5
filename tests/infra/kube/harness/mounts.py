"""Namespaces per container, as a container runtime gives them: the process kubelet's pods see their own
/dev/shm and their volumes at their real paths, nothing they mount reaches the host (a mount namespace),
and what they signal stays inside (a PID namespace: Argo's executor forwards a SIGTERM with kill(-1),
which on a shared PID namespace ends every process of the machine)."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import threading
from dataclasses import dataclass

# What containerd and Docker mount on a container's /dev/shm unless told otherwise.
DEV_SHM_OPTIONS = "nosuid,nodev,noexec,mode=1777,size=64m"
FIRST_FD = 10  # bind sources' descriptors: above the 0-9 a shell script may use (bash takes any number)


@dataclass(frozen=True)
class Mount:
    """One mount made inside a container's mount namespace before its command runs: a fresh
    filesystem (``fstype`` "tmpfs", ...) or, with fstype "bind", a directory or file of the pod's
    (``source``) shown at ``target`` (``options`` "ro": read-only)."""

    target: str
    fstype: str
    source: str = "none"
    options: str = ""

    def shell(self, fd: int | None = None) -> str:
        """The mount as shell lines; a bind mount's source is given as descriptor ``fd``, opened
        before any mount (an earlier mount, say an emptyDir on /tmp, may hide the source's path)."""
        q = shlex.quote
        if self.fstype == "bind":
            # The target is made where it is missing (in the volume mounted above it, if any): an
            # empty directory, or an empty file for a file, as runtimes make them.
            src, tgt = f"/proc/self/fd/{fd}", q(self.target)
            make = (
                f'if [ -d {src} ]; then mkdir -p {tgt}; else mkdir -p "$(dirname {tgt})"; [ -e {tgt} ] || : > {tgt}; fi'
            )
            ro = f"\nmount -o remount,bind,ro {tgt}" if "ro" in self.options.split(",") else ""
            return f"{make}\nmount --no-canonicalize --bind {src} {tgt}{ro}"
        opts = f" -o {q(self.options)}" if self.options else ""
        return f"mount -t {q(self.fstype)}{opts} {q(self.source)} {q(self.target)}"


def private_dev_shm() -> Mount:
    return Mount("/dev/shm", "tmpfs", "shm", DEV_SHM_OPTIONS)


# PID 1 of the container's namespace, as `docker run --init` gives one: it runs the command as its child
# and passes SIGTERM and SIGINT on, so the command is not PID 1 (which the kernel shields from the
# signals it has no handler for, its own SIGKILL included) and kill(-1) from inside spares the init.
# Its exit status is the command's (128 + N for a signal).
INIT = """
set +e
"$@" &
child=$!
trap 'kill -TERM $child 2>/dev/null' TERM
trap 'kill -INT $child 2>/dev/null' INT
while :; do
  wait $child; rc=$?
  kill -0 $child 2>/dev/null || exit $rc
done
"""


def in_namespaces(
    argv: list[str], mounts: list[Mount], *, map_root_user: bool = False, cwd: str | None = None
) -> list[str]:
    """``argv`` wrapped to run in mount and PID namespaces of its own, after ``mounts``, in ``cwd`` (a
    path as the container sees it) when given.

    Propagation is private, so nothing mounted inside reaches the host's namespace, and the mounts go
    away with the last process in it. The PID namespace has its own /proc; its PID 1 is INIT, and
    everything in it dies with it (and INIT with the wrapper: --kill-child). The wrapper (unshare)
    ignores SIGTERM and SIGINT: send those to its child, INIT (``namespace_init``); SIGKILL its process
    group to kill the container. A failed mount fails the container (exit code of mount, message in its
    log)."""
    fds = {i: FIRST_FD + i for i, m in enumerate(mounts) if m.fstype == "bind"}
    script = "set -e\n" + "".join(f"exec {fd}<{shlex.quote(mounts[i].source)}\n" for i, fd in fds.items())
    script += "".join(m.shell(fds.get(i)) + "\n" for i, m in enumerate(mounts))
    script += "".join(f"exec {fd}<&-\n" for fd in fds.values())
    if cwd:
        script += f"mkdir -p {shlex.quote(cwd)}\ncd {shlex.quote(cwd)}\n"  # as runtimes make a missing workingDir
    script += INIT
    unshare = [
        _tool("unshare"),
        "--mount",
        "--propagation",
        "private",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
    ]
    if map_root_user:
        unshare.append("--map-root-user")
    return [*unshare, "--", _tool("bash"), "-c", script, "container", *argv]


def namespace_init(wrapper_pid: int) -> int | None:
    """The PID (as the host sees it) of INIT, the wrapper's one child; None before it has forked. Any of the
    wrapper's threads may have forked it (runc's do)."""
    children = []
    try:
        for task in os.listdir(f"/proc/{wrapper_pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{wrapper_pid}/task/{task}/children") as f:
                children += f.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def namespace_pids(wrapper_pid: int) -> set[int]:
    """Every process of the container the wrapper ``wrapper_pid`` runs (host PIDs): the wrapper and all the processes
    of its PID namespace, whatever their process group or session (a command may start one of its own)."""
    init = namespace_init(wrapper_pid)
    pids = {wrapper_pid}
    if init is None:
        return pids
    try:
        ns = os.readlink(f"/proc/{init}/ns/pid")
    except OSError:
        return pids
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                    pids.add(int(entry))
    return pids


def _tool(name: str) -> str:
    # Absolute: a pod's own PATH must not decide which unshare/sh/mount wraps it.
    path = shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if path is None:
        raise MountNamespaceUnavailable(f"the process kubelet needs {name}(1) to give each pod its own /dev/shm")
    return path


class MountNamespaceUnavailable(RuntimeError):
    """This machine cannot give a pod a mount namespace of its own (not root, no user namespaces)."""


_ns_mode: bool | None = None  # map_root_user, once known
_ns_mode_lock = threading.Lock()


def mount_namespace_mode() -> bool:
    """Whether containers need ``--map-root-user`` (not root, user namespaces allowed): tried
    once per process with a real tmpfs on /dev/shm in a throwaway namespace."""
    global _ns_mode
    with _ns_mode_lock:
        if _ns_mode is None:
            errors = []
            for map_root_user in (False, True):
                argv = in_namespaces(["true"], [private_dev_shm()], map_root_user=map_root_user)
                p = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
                if p.returncode == 0:
                    _ns_mode = map_root_user
                    break
                errors.append(f"{shlex.join(argv[:5])}: {p.stderr.strip() or p.returncode}")
            else:
                raise MountNamespaceUnavailable(
                    "the process kubelet gives each pod its own /dev/shm (a mount namespace per pod, as "
                    "a real node has) and cannot here; run as root or allow unprivileged user "
                    "namespaces. Tried: " + "; ".join(errors)
                )
        return _ns_mode
