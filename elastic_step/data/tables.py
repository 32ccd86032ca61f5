"""Arrow tables as prep keeps them in memory."""

from __future__ import annotations

import pyarrow as pa


def compact(table: pa.Table) -> pa.Table:
    """A copy of `table` in fresh contiguous buffers: not a slice holding a whole sort unit in memory,
    and laid out the same whatever the pieces it came from."""
    if not table.num_rows:
        return table
    return pa.Table.from_arrays([pa.concat_arrays(c.chunks) for c in table.columns], schema=table.schema)
