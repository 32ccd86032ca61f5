"""What a worker makes of a shard's silence (ps/client.py), over real gRPC: a call that reaches its deadline means
the shards moved (the master finds a frozen shard and restores them as a new generation), as a lost shard does;
any other error is still an error."""

from __future__ import annotations

import grpc
import pytest

from elastic_step.ps.client import PSClient, ShardsMoved, shards_moved
from tests.unit.ps.frozen_shard import FrozenShard, serving


@pytest.fixture
def address():
    servicer = FrozenShard(frozen=True)
    with serving(servicer) as at:
        yield servicer, at


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
