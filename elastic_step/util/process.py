"""Process plumbing every worker, PS and preloader process sets up first: dying with its parent, and
TensorFlow's C++ log level."""

from __future__ import annotations

import os
import sys

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


def quiet_tensorflow() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
