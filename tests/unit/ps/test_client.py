"""What a worker makes of a shard's silence (ps/client.py), over real gRPC: a call that reaches its deadline means
the shards moved (the master finds a frozen shard and restores them as a new generation), as a lost shard does;
any other error is still an error."""

from __future__ import annotations

import threading

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


def test_a_call_in_flight_when_the_client_closes_its_channels_is_a_move():
    """The shards moved (a shard's pod deleted): the worker closes its channels to them while another of its threads
    still has a call in flight, which ends CANCELLED. That thread re-registers for the shards' new generation, as
    the first did, instead of failing the worker as an internal error."""
    shard = FrozenShard(frozen=True)
    with serving(shard) as at:
        client = PSClient([at], "token", timeout=30)
        raised = []

        def pull():
            try:
                client.pull_dense_at()
            except BaseException as e:  # noqa: BLE001 - looked at below
                raised.append(e)

        puller = threading.Thread(target=pull)
        puller.start()
        while not shard.pulls:  # in flight: the frozen shard holds it
            threading.Event().wait(0.01)
        client.close()
        puller.join(timeout=30)
    assert len(raised) == 1 and isinstance(raised[0], ShardsMoved) and "CANCELLED" in str(raised[0]), raised
