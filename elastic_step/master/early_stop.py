"""Early stopping, as Keras's `EarlyStopping(restore_best_weights=True)` decides it, on the eval curve's points.

With it on, an epoch's end waits for that epoch's point (the ledger holds the next epoch: leases/ledger.py), so the
job ends with the epoch whose point ran out of patience, and the epochs that ran are the ledger's and the audit's.
The best epoch's weights are kept from the point's model and are the ones the job saves and publishes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from elastic_step.errors import ConfigError


@dataclass
class EarlyStop:
    """`metric` of each point, improving by more than `min_delta` (down for a loss, up for any other metric),
    with `patience` epochs without improvement before training stops, as Keras counts them."""

    metric: str
    patience: int
    min_delta: float
    best: float | None = None
    best_epoch: int | None = None
    stopped_epoch: int | None = None
    wait: int = 0
    best_weights: list | None = field(default=None, repr=False)

    @property
    def lower_is_better(self) -> bool:
        return self.metric.endswith("loss")

    def improves(self, value: float) -> bool:
        if self.best is None:
            return math.isfinite(value)
        if self.lower_is_better:
            return value + self.min_delta < self.best
        return value - self.min_delta > self.best

    def after_epoch(self, epoch: int, point: dict, weights) -> bool:
        """Epoch `epoch`'s point (its metrics); `weights()`: the model's weights it evaluated, taken when they
        are the best so far. True: training stops after this epoch."""
        if self.metric not in point:
            raise ConfigError(
                f"--early-stop-metric {self.metric!r} is not computed by the evaluation, which reports "
                f"{sorted(k for k in point if k not in ('epoch', 't', 'records'))}. Pick one of those."
            )
        value = float(point[self.metric])
        self.wait += 1
        if self.improves(value):
            self.best, self.best_epoch, self.wait = value, epoch, 0
            self.best_weights = weights()
            return False
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            return True
        return False

    def summary(self, epochs: int) -> dict:
        """For summary.json: the best epoch (from 0) and its value, and why training ended."""
        stopped = self.stopped_epoch is not None
        reason = (
            f"{self.metric} did not improve by more than {self.min_delta:g} for {self.patience} epoch(s) after epoch "
            f"{self.best_epoch + 1}"
            if stopped
            else f"all {epochs} epochs ran"
        )
        return {
            "metric": self.metric,
            "patience": self.patience,
            "min_delta": self.min_delta,
            "best_epoch": self.best_epoch,
            "best": self.best,
            "stopped_epoch": self.stopped_epoch,
            "reason": reason,
        }
