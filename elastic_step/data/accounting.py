"""The exactly-once accounting: which records the updates a copy of the model holds were trained on, and how a
minibatch is named in it, as a push, a step's contribution, a checkpoint and the audit (master/durability/audit.py)
all name it."""

from __future__ import annotations

import numpy as np


def minibatch_end(task_start: int, end: int, lo: int, size: int) -> int:
    """The end of the minibatch of `size` records that holds record `lo`, in a task starting at `task_start` and
    leased up to `end`: minibatches are cut from the task's own start, so a remainder leased after a loss is cut
    (and keyed) as the lost worker cut it."""
    return min(end, task_start + ((lo - task_start) // size + 1) * size)


def skipped_key(epoch: int, data_shard: int) -> tuple[int, int]:
    """A minibatch skipped, not applied (--skip-non-finite: its loss or gradient was not finite), is named by its
    data shard's complement (~index, negative; the same function maps it back): in a push's key, a step's
    contribution and AppliedRecords, so that it travels wherever applied ranges do (a checkpoint, a peer's state,
    the shards' stats) and the audit tells the two apart."""
    return epoch, ~data_shard


class AppliedRecords:
    """The records whose updates a copy of the model holds (a PS shard's, or an allreduce member's):
    per (epoch, data shard index in the training manifest), the [start, end) range of each applied
    update. A range that starts where the last one ended extends it (a lease's minibatches arrive
    in order); any other, overlapping ones included, is kept apart, so a record applied twice shows.
    The exactly-once audit (master/durability/audit.py) lays them over the data set."""

    def __init__(self):
        self.ranges: dict[tuple[int, int], list[list[int]]] = {}

    def add(self, epoch: int, data_shard: int, start: int, end: int) -> None:
        ranges = self.ranges.setdefault((epoch, data_shard), [])
        if ranges and ranges[-1][1] == start:
            ranges[-1][1] = end
        else:
            ranges.append([start, end])

    def arrays(self) -> dict[tuple[int, int], np.ndarray]:
        return {k: np.array(v, dtype=np.int64).reshape(-1, 2) for k, v in self.ranges.items()}

    @classmethod
    def of(cls, arrays: dict[tuple[int, int], np.ndarray]) -> AppliedRecords:
        out = cls()
        out.ranges = {k: [list(map(int, r)) for r in np.asarray(v).reshape(-1, 2)] for k, v in arrays.items()}
        return out

    def npz(self) -> dict[str, np.ndarray]:
        """As .npz entries (`records/<epoch>/<data shard>`), beside a saved model state's own arrays."""
        return {f"records/{e}/{d}": r for (e, d), r in self.arrays().items()}

    @classmethod
    def of_npz(cls, saved: dict[str, np.ndarray]) -> AppliedRecords:
        return cls.of(
            {tuple(int(x) for x in k.split("/")[1:]): v for k, v in saved.items() if k.startswith("records/")}
        )
