"""A minibatch's records, as a user finds them in the data, and the minibatch an error was raised on: a worker's
failure report names it, and the master takes the same error from two instances on the same minibatch as final
(master/relaunch.py)."""

from __future__ import annotations

import contextlib
from typing import NamedTuple


class Records(NamedTuple):
    """[start, end) of data shard `shard` (its URI; `data_shard`: its index in the training manifest) in epoch
    `epoch` (from 0; told from 1)."""

    shard: str
    data_shard: int
    epoch: int
    start: int
    end: int

    def __str__(self) -> str:
        return f"records [{self.start}, {self.end}) of {self.shard} in epoch {self.epoch + 1}"


_ATTRIBUTE = "elastic_step_minibatch"


@contextlib.contextmanager
def working_on(records: Records | str):
    """An error raised inside carries the records it was raised on (the innermost `working_on` names them)."""
    try:
        yield
    except BaseException as e:
        if getattr(e, _ATTRIBUTE, None) is None:
            with contextlib.suppress(AttributeError, TypeError):  # an exception that takes no attributes
                setattr(e, _ATTRIBUTE, str(records))
        raise


def minibatch_of(error: BaseException) -> str:
    """The records `error` was raised on (see `working_on`), or "" when unknown."""
    return getattr(error, _ATTRIBUTE, None) or ""
