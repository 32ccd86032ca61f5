"""A minibatch whose loss or gradient is not finite: by default it stops the job before anything of it is applied,
as Keras's TerminateOnNaN stops `fit` (one NaN applied makes every weight NaN, and the job would go on to
"succeed"); with --skip-non-finite it is skipped instead: nothing of it is applied, and its records are accounted
as skipped, by whoever holds the model's state (the audit's evidence) and in summary.json."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import numpy as np

from elastic_step.errors import DataError
from elastic_step.worker.records import Records

log = logging.getLogger("elastic_step.worker")


def not_finite(loss: float, gradients: Sequence[np.ndarray], names: Sequence[str] = ()) -> str | None:
    """What is not finite, in words ("the loss became nan"), or None when the loss and every gradient are finite.
    `names`: the variable each of `gradients` belongs to, when they are one per variable."""
    if not math.isfinite(loss):
        return f"the loss became {loss}"
    bad = next((i for i, g in enumerate(gradients) if not np.isfinite(g).all()), None)
    if bad is None:
        return None
    g = np.asarray(gradients[bad])
    what = f"the gradient of {names[bad]!r}" if bad < len(names) else "a gradient"
    return f"{what} became {g[~np.isfinite(g)].flat[0]} (the loss was {loss:.6g})"


class NonFinite:
    """What a worker does with a minibatch whose loss or gradient is not finite: fail (the default), or, with
    `skip`, skip it, telling `report(records, why)` (the master, which counts it in summary.json)."""

    def __init__(self, skip: bool = False, report: Callable[[Records | None, str], None] | None = None):
        self.skip = skip
        self.report = report

    def check(self, loss: float, gradients: Sequence[np.ndarray], at: Records | None, names: Sequence[str] = ()):
        """None when the minibatch `at` may be applied; else, when skipping, why it is skipped. Raises a DataError
        naming the minibatch when not skipping."""
        why = not_finite(loss, gradients, names)
        if why is None:
            return None
        where = str(at) if at is not None else "a minibatch"
        if not self.skip:
            raise DataError(
                f"Training stopped: {why} on {where}, before it was applied. The model diverged (a learning rate "
                "too high for it), or those records hold a NaN or infinite value: `elastic-step data prep` reports "
                "them. Lower the learning rate, fix or drop those records, or pass --skip-non-finite to skip such "
                "minibatches (counted in summary.json)."
            )
        log.warning("skipped %s: %s (--skip-non-finite: nothing of it is applied)", where, why)
        if self.report is not None:
            self.report(at, why)
        return why
