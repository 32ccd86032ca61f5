"""A minibatch whose loss or gradient is not finite stops the job before anything of it is applied, as Keras's
TerminateOnNaN stops `fit`: one NaN applied makes every weight NaN, and the job would go on to "succeed"."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from elastic_step.errors import DataError


def where(shard: str, epoch: int, lo: int, hi: int) -> str:
    """A minibatch, as a user finds it in the data: its records, its data shard, its epoch (from 1)."""
    return f"records [{lo}, {hi}) of {shard} in epoch {epoch + 1}"


def require_finite(loss: float, gradients: Sequence[np.ndarray], at: str, names: Sequence[str] = ()) -> None:
    """Raise a DataError naming the minibatch (`at`) when its loss or a gradient is NaN or infinite.
    `names`: the variable each of `gradients` belongs to, when they are one per variable."""
    if math.isfinite(loss):
        bad = next((i for i, g in enumerate(gradients) if not np.isfinite(g).all()), None)
        if bad is None:
            return
        g = np.asarray(gradients[bad])
        value = g[~np.isfinite(g)].flat[0]
        what = f"the gradient of {names[bad]!r}" if bad < len(names) else "a gradient"
        what += f" became {value} (the loss was {loss:.6g})"
    else:
        what = f"the loss became {loss}"
    raise DataError(
        f"Training stopped: {what} on {at}, before it was applied. The model diverged (a learning rate too "
        "high for it), or those records hold a NaN or infinite value: `elastic-step data prep` reports them. "
        "Lower the learning rate, or fix or drop those records."
    )
