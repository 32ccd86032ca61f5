"""What a worker makes of a shard's silence (ps/client.py), over real gRPC: a call that reaches its deadline means
the shards moved (the master finds a frozen shard and restores them as a new generation), as a lost shard does;
any other error is still an error."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from elastic_step.proto import elastic_pb2_grpc as pb_grpc
from elastic_step.proto import rpc
from elastic_step.ps.client import PSClient, ShardsMoved, shards_moved


class Shard(pb_grpc.ParameterServerServicer):
    """A shard that never answers a pull while `frozen` (a stopped process's port), else refuses it."""

    def __init__(self):
        self.frozen = threading.Event()
        self.frozen.set()

    def PullDense(self, request, context):
        while self.frozen.is_set() and context.is_active():
            time.sleep(0.02)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not a pull this shard serves")


@pytest.fixture
def address():
    servicer, server = Shard(), rpc.server(max_workers=2)
    pb_grpc.add_ParameterServerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    servicer.frozen.clear()
    server.stop(grace=0)


def test_a_pull_from_a_frozen_shard_that_reaches_its_deadline_is_a_move_and_another_error_is_not(address):
    servicer, at = address
    client = PSClient([at], "token", timeout=0.5)
    try:
        with pytest.raises(ShardsMoved, match="DEADLINE_EXCEEDED"):
            client.pull_dense_at()
        servicer.frozen.clear()
        with pytest.raises(grpc.RpcError) as refused:
            client.pull_dense_at()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and not shards_moved(refused.value)
    finally:
        client.close()
    assert shards_moved(TimeoutError("a doorbell that never rings back"))  # the shared-memory path's deadline
    assert shards_moved(ConnectionResetError()) and not shards_moved(ValueError())
