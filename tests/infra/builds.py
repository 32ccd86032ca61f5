"""The Go-built servers the tests need, seen from pytest-xdist's scheduler.

On a machine without them, scripts/test builds them in the background (minutes each) while the suite runs.
The tests that need them are groups of their own (tests/conftest.py), each on one worker with its own
control plane. ``BuildAwareScheduling`` is xdist's `loadgroup` scheduling that hands a worker such a group
only once the builds the group names are done, and the next other group until then: a worker does not sit on
a build's lock while there is other work, unless its group says so. A warm machine sees xdist's own order.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from xdist.scheduler import LoadGroupScheduling

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def built(script: str) -> bool:
    """Whether scripts/<script> has its binaries, asked without building or waiting (ELASTIC_STEP_BUILD_CHECK)."""
    proc = subprocess.run(
        [str(SCRIPTS / script)],
        env={**os.environ, "ELASTIC_STEP_BUILD_CHECK": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc.returncode == 0


class BuildAwareScheduling(LoadGroupScheduling):
    """`--dist loadgroup`, where a group in `needs` (group -> the scripts/build-* it needs) is handed out once
    its builds are done, or when nothing else is left (its first test then waits on the build's lock)."""

    def __init__(self, config, log=None, *, needs: dict[str, tuple[str, ...]]):
        super().__init__(config, log)
        self.needs = needs
        self._done: set[str] = set()

    def _ready(self, group: str) -> bool:
        missing = [b for b in self.needs.get(group, ()) if b not in self._done]
        self._done.update(b for b in missing if built(b))
        return all(b in self._done for b in missing)

    def _assign_work_unit(self, node) -> None:
        ready = next((group for group in self.workqueue if self._ready(group)), None)
        if ready is not None:
            self.workqueue.move_to_end(ready, last=False)  # xdist pops the queue's first
        super()._assign_work_unit(node)
