"""A stand-in instance for test_preloaded.py, run as `python -m tests.unit.backends.instance_program
ACTION`: reports what it inherited, then exits, sleeps or raises as ACTION says."""

import json
import logging
import os
import sys

if __name__ == "__main__":
    print(
        json.dumps(
            {
                "argv": sys.argv,
                "pid": os.getpid(),
                "ppid": os.getppid(),
                "sid": os.getsid(0),
                "env": os.environ.get("INSTANCE_PROGRAM"),
                "env_size": len(os.environ),
                "tensorflow_preloaded": "tensorflow" in sys.modules,
                "logging_handlers": len(logging.root.handlers),  # none: an instance configures its own
            }
        ),
        flush=True,
    )
    action = sys.argv[1]
    if action.startswith("exit:"):
        sys.exit(int(action[5:]))
    if action == "sleep":
        import time

        time.sleep(600)
    if action == "raise":
        raise ValueError("the instance's own error")
