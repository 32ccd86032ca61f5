"""The CLI's exit (util/process.py): Python's own shutdown runs whole before the native teardown is skipped."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from elastic_step.util.process import exit_before_native_teardown

    def late():
        time.sleep(0.3)
        print("the non-daemon thread finished", flush=True)

    threading.Thread(target=late).start()
    atexit.register(lambda: sys.stdout.write("the atexit handler ran, unflushed"))
    exit_before_native_teardown(3)
    print("never")
    """
)


def test_the_exit_joins_threads_runs_atexit_flushes_and_keeps_the_code():
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    # The thread still sleeping at the call is waited for, then the handlers run, then what they left in stdout's
    # buffer is written: as at the interpreter's own exit.
    assert proc.stdout == "the non-daemon thread finished\nthe atexit handler ran, unflushed"
