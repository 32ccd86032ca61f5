"""A shard whose port stays open but answers nothing while `frozen` is set, as a stopped process's does: what the
master's probe (master/gray/ps_watch.py) and a worker's pull (ps/client.py) meet when a PS freezes. A stand-in for a
real shard only in its silence: a SIGSTOPped real one is in tests/integration/test_hangs.py."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import grpc

from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import elastic_pb2_grpc as pb_grpc
from elastic_step.proto import rpc


class FrozenShard(pb_grpc.ParameterServerServicer):
    def __init__(self, frozen: bool = False):
        self.frozen = threading.Event()
        if frozen:
            self.frozen.set()
        self.briefs = 0  # brief Stats asked (the master's probe)
        self.pulls = 0  # pulls under way or done

    def _silent(self, context) -> None:
        while self.frozen.is_set() and context.is_active():
            time.sleep(0.02)

    def Stats(self, request, context):
        rpc.check_token(context, "token", request.token)
        self.briefs += request.brief
        self._silent(context)
        return pb.PsStats(shard=0)

    def PullDense(self, request, context):
        self.pulls += 1
        self._silent(context)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not a pull this shard serves")


@contextlib.contextmanager
def serving(shard: FrozenShard) -> Iterator[str]:
    """The shard on a loopback port; its address."""
    server = rpc.server(max_workers=4)
    pb_grpc.add_ParameterServerServicer_to_server(shard, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        shard.frozen.clear()
        server.stop(grace=0)
