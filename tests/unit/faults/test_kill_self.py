"""kill_self: fault injection that works as a container's PID 1 too, where the kernel ignores a process's
own SIGKILL (a container without an init runs its command as PID 1)."""

import shutil
import signal
import subprocess
import sys

import pytest

KILL = "from elastic_step.faults.process import kill_self; import signal; kill_self(signal.SIGKILL); print('survived')"


def test_a_process_dies_of_its_own_sigkill():
    proc = subprocess.run([sys.executable, "-c", KILL], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL and "survived" not in proc.stdout


def test_as_pid_1_of_its_own_namespace_it_exits_as_a_sigkill_would():
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare, "--pid", "--fork", "true"], capture_output=True) if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.fail("unshare --pid is needed (root or user namespaces), as for the kubernetes tests' kubelet")
    # Without the fallback the process would ignore the signal and print "survived".
    plain = subprocess.run(
        [
            unshare,
            "--pid",
            "--fork",
            sys.executable,
            "-c",
            "import os, signal; os.kill(os.getpid(), signal.SIGKILL); print('survived')",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "survived" in plain.stdout, "PID 1 should have been shielded from its own SIGKILL"
    proc = subprocess.run(
        [unshare, "--pid", "--fork", sys.executable, "-c", KILL], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 128 + signal.SIGKILL and "survived" not in proc.stdout, (proc.returncode, proc.stdout)
