"""Process plumbing every worker, PS and preloader process sets up first: dying with its parent, and
TensorFlow's C++ log level; this process's threads as the kernel sees them; and the exit of the CLI and of a
forked instance."""

from __future__ import annotations

import os
import sys
from typing import NamedTuple, NoReturn

# Set by the local backend: the master's pid. Its instances die with it, as pods go with their owner
# on Kubernetes, so a SIGKILLed master leaves no process behind to push into shards nobody will read.
PARENT_ENV = "ELASTIC_STEP_PARENT_PID"


def die_with_parent() -> None:
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):  # it died before we asked
        os._exit(1)


def exit_before_native_teardown(code: int, join_threads: bool = True) -> NoReturn:
    """End this process with `code` after Python's own shutdown (its non-daemon threads joined unless
    `join_threads` is off, the atexit handlers run, stdio flushed), skipping the C++ static destructors that the
    interpreter's exit runs next. In a process that has loaded TensorFlow, those can find one of its native threads
    still joinable and abort ("terminate called without an active exception"): a clean exit code would become
    SIGABRT. A forked child must skip them anyway: they are its parent's."""
    import atexit
    import threading

    try:
        if join_threads:
            threading._shutdown()  # what the interpreter's exit does first: join the non-daemon threads
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def quiet_tensorflow() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


class Thread(NamedTuple):
    tid: int
    # The kernel's name (comm): TensorFlow names its inter-op pool's threads tf_*; its intra-op (Eigen) threads and
    # Python's carry the process's name.
    name: str
    cpu_s: float  # user and system time so far


def own_threads() -> list[Thread]:
    """This process's threads alive now (none where /proc is not)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    tick = os.sysconf("SC_CLK_TCK")
    found = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        # comm may hold spaces or parentheses: it runs from the first "(" to the last ")"; utime and stime are
        # the 12th and 13th fields after it.
        fields = stat[stat.rindex(")") + 2 :].split()
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        found.append(Thread(int(task), name, (int(fields[11]) + int(fields[12])) / tick))
    return found
