"""JSON as every output of ours writes it: strict JSON, which any parser reads.

Python's json writes a float NaN or infinity as a bare `NaN` / `Infinity`, which strict parsers (JavaScript's,
Go's, jq) refuse. Here such a value is `null`, as JavaScript's JSON.stringify writes it, and numpy's scalars
and arrays are plain numbers and lists.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from elastic_step.util.atomic import atomic_write_text


def plain(value: Any) -> Any:
    """`value` with every non-finite float as None, numpy values as Python's, tuples as lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (np.generic, np.ndarray)):
        return plain(value.tolist())
    return value


def dumps(value: Any, indent: int | None = None) -> str:
    """Strict JSON text of `value`; other objects (paths, enums) as their str()."""
    return json.dumps(plain(value), indent=indent, default=str, allow_nan=False)


def dump(value: Any, f, indent: int | None = None) -> None:
    f.write(dumps(value, indent))


def write_json(uri: str, value: Any, indent: int | None = 2) -> None:
    """Write `value` as strict JSON to `uri` (local or any fsspec URI), atomically."""
    atomic_write_text(uri, dumps(value, indent))
