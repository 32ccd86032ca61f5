"""The client of an allreduce member's Collective service, as the master and a newcomer member call it: pull a
member's state (its weights, its optimizer's, the records they hold) once it has applied a given step (or, for
the master, a later one). The service is worker/allreduce/collective.py; the client lives with the instances,
below every role that calls it, and knows the member only by its wire contract (elastic.proto)."""

from __future__ import annotations

import grpc

from elastic_step.errors import ElasticStepError
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


def pull_state_since(address: str, token: str, step: int, timeout: float = 60.0) -> tensors.MemberState:
    """The state of the member at `address` once it has applied `step`, or a later step's if it is past it: the
    master's pull of a step it committed. A member applies a commit only once the master's answer reaches it, and
    serves the state before the run until then: a pull of its current state at once could be that earlier one."""
    try:
        return pull_state(address, token, step, timeout)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.FAILED_PRECONDITION:  # the member is past `step` (or never got there)
            raise
    state = pull_state(address, token, -1, timeout)
    if state.step < step:
        raise ElasticStepError(f"the member at {address} is at step {state.step}, not yet at step {step}")
    return state
