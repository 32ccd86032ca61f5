"""Fencing: a worker launch the master gave up can apply nothing.

The master gives a launch up when it declares it lost: declared hung, or lost or ended as the backend says, its
lease requeued from its watermark for another worker. A process can outlive that: a frozen worker resumed before
its kill lands, a pod in its grace period, a partitioned node whose network returns. Its name (`worker-1`) is its
successor's too, so every launch carries its number (Instance.launch, from the master at each launch), and a given-up
launch is *fenced*:
  * the master refuses its every call (PERMISSION_DENIED, "fenced: ..."): its reports, lease requests, step
    reports, registrations;
  * the PS shards are told (ParameterServer.Fence, before its lease is requeued) and refuse its pushes;
  * the worker, refused, logs the refusal and exits at once (EXIT_FENCED), a loss the master already counted.
Per worker, every launch up to the highest fenced one is fenced: launches only grow, and a successor's is higher.
A call that names no launch (0) is never refused: nothing launched by a master sends one. A call naming a launch
above the master's own count is an instance a previous master launched and this one adopted (a pod kept as it was):
the count rises to it, so that it is the launch fenced, and its successor's number comes after it.

Plain data, no clock and no threads: the coordinator keeps it under its lock.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Fenced:
    launch: int  # every launch up to this one
    why: str  # what the master declared, e.g. "declared hung, no progress for 6.0 s (bound 6 s)"
    refused: int = 0  # its calls refused since


class Fences:
    def __init__(self) -> None:
        self.fenced: dict[str, Fenced] = {}  # worker -> its highest fenced launch

    def fence(self, worker: str, launch: int, why: str) -> bool:
        """Fence `worker`'s launches up to `launch`. False when they were already."""
        f = self.fenced.get(worker)
        if launch <= 0 or (f is not None and f.launch >= launch):
            return False
        self.fenced[worker] = Fenced(launch, why, f.refused if f else 0)
        return True

    def refusal(self, worker: str, launch: int) -> str | None:
        """Why a call of `worker`'s launch `launch` is refused (it begins "fenced: "), or None: it is not fenced.
        Counts the refusal."""
        f = self.fenced.get(worker)
        if launch <= 0 or f is None or launch > f.launch:
            return None
        f.refused += 1
        return f"fenced: {worker} launch {launch} was given up by the master ({f.why}); its lease went to another"

    def refused(self) -> int:
        return sum(f.refused for f in self.fenced.values())

    def summary(self) -> dict:
        return {
            "fenced": {
                w: {"launch": f.launch, "why": f.why, "refused": f.refused} for w, f in sorted(self.fenced.items())
            },
            "refused": self.refused(),
        }
