"""gRPC plumbing shared by every role: channel options, token check, retrying client calls."""

from __future__ import annotations

import hmac
import time
from concurrent import futures

import grpc

# Parameters travel in one message per shard: raise the 4 MB default.
GRPC_OPTIONS = [("grpc.max_send_message_length", 512 << 20), ("grpc.max_receive_message_length", 512 << 20)]

# A server that receives small messages only: no bandwidth probing, which pings back at every burst of data a
# connection receives and cost the master a fifth of its CPU per call (bench/master_capacity.py). Its clients keep
# it: a checkpoint's state comes to them from the master (PullCheckpointState).
SMALL_CALLS = [("grpc.http2.bdp_probe", 0)]

# A call's deadline, unless it says otherwise. The master measures how long its calls queue from what is left of
# it (master/service.py, Admission), so the calls it may shed keep this one.
CALL_TIMEOUT_S = 30.0
# The deadline an instance opens its Session stream with (a day: past it, the stream is opened again). What is left
# of it when the master serves the stream's first call tells how long the stream queued, as for a unary call. A
# whole number of the unit gRPC's encoding rounds it up to (hundreds of seconds), so the master can undo the
# rounding (master/service.py, Admission).
SESSION_DEADLINE_S = 86400.0

TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


WRONG_TOKEN = "wrong job token"


def token_ok(expected: str, got: str) -> bool:
    """Whether a call carries this job's token (constant-time comparison)."""
    return hmac.compare_digest(expected.encode(), got.encode())


def check_token(context: grpc.ServicerContext, expected: str, got: str) -> None:
    """Abort the call unless it carries this job's token."""
    if not token_ok(expected, got):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, WRONG_TOKEN)


def server(max_workers: int = 16) -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=GRPC_OPTIONS)


def host_of(address: str) -> str:
    """The host of a "host:port" address (an IPv6 one without its brackets)."""
    return address.rsplit(":", 1)[0].strip("[]")


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=GRPC_OPTIONS)


def call(method, request, *, timeout: float = CALL_TIMEOUT_S, retry_for: float = 60.0):
    """Call a unary RPC, retrying transient failures (a peer still starting) for `retry_for` s."""
    deadline = time.monotonic() + retry_for
    delay = 0.05
    while True:
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as e:
            if e.code() not in TRANSIENT or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(1.0, delay * 2)
