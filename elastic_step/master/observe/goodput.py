"""Goodput: the share of the step's wall time, and of its worker-seconds, that produced records committed once.

The master always knows what it is doing: starting up, waiting for workers (or for the platform to admit them),
holding the workers for a checkpoint, restoring from one, evaluating, finishing, or training. The pump tells
`Goodput` at every turn (`now_doing`), and the work that stops the pump declares itself (`doing`); each interval
of wall time goes to what the master was doing over it, and its worker-seconds (workers launched and not yet
gone, times the interval) with it. While training, workers not training (pending, queued, registering) count as
waiting. Training that did not count, records trained again after a loss (a worker's lease requeued past its last
report, a rewind to a checkpoint), is taken out of training in proportion: the `rewind` cause.

Figures, not decisions: nothing the master decides reads them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

TRAINING = "training"
# Every cause of time that did not produce records committed once, in the order the report shows them, as the
# summary line says them.
SAID = {
    "startup": "start-up",
    "waiting": "waiting for workers",
    "rewind": "training again",
    "checkpoint": "checkpoints",
    "restore": "restores",
    "evaluation": "evaluation",
    "finishing": "saving the model",
}
CAUSES = tuple(SAID)


class Goodput:
    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self.started_at = clock()
        self._since = self.started_at
        self._doing = "startup"
        self._workers = (0, 0)  # (launched and not gone, training) over the open interval
        self._nested: list[str] = []
        self.wall_s = dict.fromkeys((TRAINING, *CAUSES), 0.0)
        self.worker_s = dict.fromkeys((TRAINING, *CAUSES), 0.0)

    def now_doing(self, what: str, workers: int, training: int, now: float | None = None) -> None:
        """From `now` on the master does `what` (TRAINING or a cause), with `workers` launched and not gone, of which
        `training` train. The interval since the last call goes to what it did then."""
        now = self._clock() if now is None else now
        self._close(now)
        if not self._nested:
            self._doing = what
        self._workers = (workers, training)

    @contextlib.contextmanager
    def doing(self, what: str) -> Iterator[None]:
        """Work that stops the pump (a checkpoint's write, a restore, the final evaluation): its time is `what`'s."""
        self._close(self._clock())
        self._nested.append(what)
        try:
            yield
        finally:
            self._close(self._clock())
            self._nested.pop()

    def _close(self, now: float) -> None:
        dt = max(0.0, now - self._since)
        self._since = now
        doing = self._nested[-1] if self._nested else self._doing
        workers, training = self._workers
        self.wall_s[doing] += dt
        if doing == TRAINING:
            self.worker_s[TRAINING] += training * dt
            self.worker_s["waiting"] += max(0, workers - training) * dt
        else:
            self.worker_s[doing] += workers * dt

    def figures(self, committed: int, trained_again: int, now: float | None = None) -> dict:
        """Goodput now: `committed` records committed once, `trained_again` records trained more than once. The
        ratios and each cause's seconds (wall and worker), as summary.json and /metrics show them."""
        now = self._clock() if now is None else now
        wall, worker = dict(self.wall_s), dict(self.worker_s)
        doing = self._nested[-1] if self._nested else self._doing
        open_s = max(0.0, now - self._since)  # the interval still open, without closing it (a scrape changes nothing)
        wall[doing] += open_s
        workers, training = self._workers
        worker[doing] += (training if doing == TRAINING else workers) * open_s
        if doing == TRAINING:
            worker["waiting"] += max(0, workers - training) * open_s
        redone = trained_again / (committed + trained_again) if committed + trained_again else 0.0
        for spent in (wall, worker):
            spent["rewind"] += spent[TRAINING] * redone
            spent[TRAINING] *= 1.0 - redone
        total_wall, total_worker = sum(wall.values()), sum(worker.values())
        return {
            "ratio": round(wall[TRAINING] / total_wall, 4) if total_wall else 0.0,
            "worker_ratio": round(worker[TRAINING] / total_worker, 4) if total_worker else 0.0,
            "wall_s": {k: round(v, 3) for k, v in wall.items()},
            "worker_s": {k: round(v, 3) for k, v in worker.items()},
        }


def describe(figures: dict) -> str:
    """One line for the step's summary: the goodput and its three largest losses."""
    wall = figures["wall_s"]
    total = sum(wall.values()) or 1.0
    lost = sorted(((v, k) for k, v in wall.items() if k != TRAINING and v > 0), reverse=True)[:3]
    rest = ", ".join(f"{SAID[k]} {100 * v / total:.0f} %" for v, k in lost)
    return (
        f"goodput {100 * figures['ratio']:.0f} % of wall time ({100 * figures['worker_ratio']:.0f} % of "
        f"worker-seconds)" + (f"; lost to {rest}" if rest else "")
    )
