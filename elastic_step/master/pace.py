"""The job's pace, as summary.json and the report show it: its throughput, its loss, how long it took from a loss
or a restart to training again, and its progress samples over time.

Figures, not decisions: the coordinator feeds them under its lock, as commits happen, and nothing it decides
reads them.
"""

from __future__ import annotations


class Pace:
    def __init__(self):
        # Throughput: the records committed after the first commit, over the span from it to the last. The first
        # commit's own records (and a resumed job's before it) were trained before that span began.
        self.first_commit_at: float | None = None
        self.committed_at_first_commit = 0
        self.last_commit_at: float | None = None
        self.loss_ema: float | None = None
        self.recovery_first_commit_s: list[float] = []  # from a worker's loss to its replacement's first commit
        self._replacement_lost_at: dict[str, float] = {}  # worker -> its predecessor's loss time
        # Recovery figures that the next commit closes: (figures, key, since) -> figures[key] = its seconds since.
        self.to_next_commit: list[tuple[dict, str, float]] = []
        self.samples: list[dict] = []  # progress over time, for the report
        self._alive_seen = 0  # the membership's alive samples already folded into a sample
        # What only the workers know, as they last said it: each launch's time computing its steps and waiting (on the
        # PS shards, or in the ring), cumulative, by (worker, launch). A launch's last figures stay once it is gone.
        self.spent: dict[tuple[str, int], tuple[float, float]] = {}
        # ... and what only the PS shards know: each shard's pushes applied and skipped, as its heartbeat last said
        # (its state's: a shard restored from a checkpoint counts from the checkpoint's).
        self.shard_pushes: dict[int, tuple[int, int]] = {}

    def committed(self, now: float, loss: float, records_total: int) -> None:
        """Records committed at `now` (the job's `records_total` since), their mean `loss`."""
        if self.first_commit_at is None:
            self.first_commit_at, self.committed_at_first_commit = now, records_total
        self.last_commit_at = now
        while self.to_next_commit:  # recovery figures: from a loss or a restart to training again
            figures, key, since = self.to_next_commit.pop()
            figures[key] = round(now - since, 3)
        if loss == loss:  # not NaN
            self.loss_ema = loss if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss

    def until_next_commit(self, figures: dict, key: str, since: float) -> None:
        """At the next commit, `figures[key]` becomes the seconds from `since` to it."""
        self.to_next_commit.append((figures, key, since))

    def worker_spent(self, worker: str, launch: int, step_s: float, wait_s: float) -> None:
        """A worker's launch says how long it has computed its steps and waited, so far."""
        self.spent[(worker, launch)] = (step_s, wait_s)

    def spent_total(self) -> tuple[float, float]:
        """Every worker launch's time computing its steps, and waiting, as they last said it."""
        return sum(s for s, _ in self.spent.values()), sum(w for _, w in self.spent.values())

    def replaced(self, worker: str, lost_at: float) -> None:
        """A replacement of `worker` was launched; its first commit closes the recovery figure."""
        self._replacement_lost_at[worker] = lost_at

    def replacement_committed(self, worker: str, now: float) -> None:
        lost_at = self._replacement_lost_at.pop(worker, None)
        if lost_at is not None:
            self.recovery_first_commit_s.append(now - lost_at)

    def throughput(self, records_total: int) -> float:
        """The steady state's records a second: those committed after the first commit, over the span from it to
        the last commit (0 before two commits)."""
        if self.first_commit_at is None or self.last_commit_at <= self.first_commit_at:
            return 0.0
        records = records_total - self.committed_at_first_commit  # < 0 after a rewind
        return max(0.0, records / (self.last_commit_at - self.first_commit_at))

    def sample(self, t: float, fields: dict, alive_samples: list[tuple[float, int]], training: int) -> dict:
        """A progress sample at `t`: `fields`, the loss, and `workers_alive`, the fewest workers training since the
        previous sample, so that a worker lost and back within one interval still shows as a dip (a relaunch can
        be quicker than the interval)."""
        changes = alive_samples[self._alive_seen :]
        self._alive_seen += len(changes)
        s = {
            "t": round(t, 3),
            **fields,
            "loss": None if self.loss_ema is None else round(self.loss_ema, 5),
            "workers_alive": min([n for _, n in changes] + [training]),
        }
        self.samples.append(s)
        return s
