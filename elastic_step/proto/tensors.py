"""numpy <-> wire tensors: raw bytes + dtype + shape (no pickles, so no code runs on decode)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from elastic_step.proto import elastic_pb2 as pb

# Only plain numeric dtypes cross the wire; anything else is a bug in the caller.
_ALLOWED = {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"}


def encode(array, out: pb.Tensor | None = None) -> pb.Tensor:
    a = np.asarray(array, order="C")  # not ascontiguousarray: it turns a 0-d scalar into shape (1,)
    if a.dtype.name not in _ALLOWED:
        raise TypeError(f"cannot send a tensor of dtype {a.dtype.name} (allowed: {sorted(_ALLOWED)})")
    t = out if out is not None else pb.Tensor()
    t.dtype = a.dtype.name
    t.shape[:] = a.shape
    t.data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
    return t


def decode(t: pb.Tensor) -> np.ndarray:
    if t.dtype not in _ALLOWED:
        raise ValueError(f"received a tensor of unsupported dtype {t.dtype!r}")
    dtype = np.dtype(t.dtype).newbyteorder("<")
    a = np.frombuffer(t.data, dtype=dtype)
    expected = int(np.prod(t.shape)) if len(t.shape) else 1
    if a.size != expected:
        raise ValueError(f"tensor payload has {a.size} values, shape {list(t.shape)} needs {expected}")
    return a.reshape(tuple(t.shape))


def encode_applied(applied: dict[tuple[int, int], np.ndarray], out) -> None:
    """(epoch, data shard) -> [start, end) ranges (int64, k x 2) into a repeated AppliedRecords field."""
    for (epoch, data_shard), ranges in applied.items():
        encode(np.asarray(ranges, dtype=np.int64).reshape(-1, 2), out.add(epoch=epoch, data_shard=data_shard).ranges)


def decode_applied(field) -> dict[tuple[int, int], np.ndarray]:
    return {(a.epoch, a.data_shard): decode(a.ranges).reshape(-1, 2) for a in field}


class MemberState(NamedTuple):
    """An allreduce member's state at a step (a peer's, or a checkpoint's)."""

    step: int
    num_model: int  # values[:num_model] are the model's weights,
    values: list[np.ndarray]  # the rest its optimizer variables
    applied: dict[tuple[int, int], np.ndarray]  # the records these weights hold


def state_reply(state: MemberState) -> pb.StateReply:
    reply = pb.StateReply(step=state.step, num_model_weights=state.num_model)
    encode_applied(state.applied, reply.applied)
    for v in state.values:
        encode(v, reply.tensors.add())
    return reply


def decode_state(reply: pb.StateReply) -> MemberState:
    return MemberState(
        reply.step, reply.num_model_weights, [decode(t) for t in reply.tensors], decode_applied(reply.applied)
    )
