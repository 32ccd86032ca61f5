"""The client of an allreduce member's Collective service, as the master and a newcomer member call it: pull a
member's state (its weights, its optimizer's, the records they hold) once it has applied a given step. The
service is worker/allreduce/collective.py; the client lives with the instances, below every role that calls it, and
knows the member only by its wire contract (elastic.proto)."""

from __future__ import annotations

from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import elastic_pb2_grpc as pb_grpc
from elastic_step.proto import rpc, tensors


def pull_state(address: str, token: str, step: int, timeout: float = 60.0) -> tensors.MemberState:
    """The state of the member at `address` once it has applied `step` (-1: whatever step it is at)."""
    ch = rpc.channel(address)
    try:
        return tensors.decode_state(
            pb_grpc.CollectiveStub(ch).PullState(pb.StateRequest(token=token, step=step), timeout=timeout)
        )
    finally:
        ch.close()
