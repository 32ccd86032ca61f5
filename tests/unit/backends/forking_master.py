"""A stand-in master for test_preloaded.py, run as `python -m tests.unit.backends.forking_master DIR [thread]`:
as the CLI's master does, it configures its logging, sends stdout to stderr and logs a line still buffered, then
forks its preloader (fork_preloader) and starts one instance through it; prints what it saw as JSON. With
`thread`, a thread of its own runs first (as in a master that already serves), so nothing may be forked."""

import contextlib
import json
import logging
import os
import sys
import threading

from elastic_step.backends.preloaded import Preloader, fork_preloader

if __name__ == "__main__":
    out, stop = sys.argv[1], threading.Event()
    if sys.argv[2:] == ["thread"]:
        threading.Thread(target=stop.wait, daemon=True).start()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    with contextlib.redirect_stdout(sys.stderr):
        sys.stderr.write("the master's own line, buffered\n")
        forked = fork_preloader()
        preloader = Preloader(os.path.join(out, "preloader.log"))
        child = preloader.start(
            [sys.executable, "-m", "tests.unit.backends.instance_program", "exit:3"],
            {"INSTANCE_PROGRAM": "mine", "PATH": os.environ["PATH"]},
            os.path.join(out, "instance.log"),
        )
        code = child.wait(120)
        with open(f"/proc/{preloader._proc.pid}/cmdline", "rb") as f:
            cmdline = f.read().split(b"\0")[:3]
        stderr = os.readlink(f"/proc/{preloader._proc.pid}/fd/2")
    print(
        json.dumps(
            {
                "forked": forked,
                "code": code,
                "preloader": preloader._proc.pid,
                "preloader_cmdline": [a.decode() for a in cmdline],
                "preloader_stderr": stderr,
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )
    # The preloader is left running: it must end with this process.
    os._exit(0)
