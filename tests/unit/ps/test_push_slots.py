"""Pushes through shared-memory slots: a real PS service on loopback gRPC, real shards, real
/dev/shm. They must apply exactly what pushes carrying their bytes apply, once per key."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from tests.unit.ps.keys import key

keras = pytest.importorskip("keras")

from elastic_step.proto import elastic_pb2_grpc as pb_grpc  # noqa: E402
from elastic_step.proto import rpc  # noqa: E402
from elastic_step.ps import push_slots  # noqa: E402
from elastic_step.ps.api import Placement  # noqa: E402
from elastic_step.ps.client import PSClient  # noqa: E402
from elastic_step.ps.server import ParameterServerService, ParameterShard  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir(push_slots.SHM_DIR), reason="no /dev/shm on this host")
TOKEN = "t0ken"


def small_model():
    keras.utils.set_random_seed(5)
    x = keras.Input(shape=(6,))
    return keras.Model(x, keras.layers.Dense(3)(keras.layers.Dense(8, activation="relu")(x)))


class CountingService(ParameterServerService):
    """Counts the pushes that came as gRPC calls (the rest were rung through the doorbell)."""

    grpc_pushes = 0

    def PushGradients(self, request, context):
        self.grpc_pushes += 1
        return super().PushGradients(request, context)


@pytest.fixture
def serve():
    """serve(optimizer) -> (service, client factory); every server and client is closed after."""
    servers, services, clients = [], [], []

    def start(optimizer):
        model = small_model()
        placement = Placement.of(model, 1)
        service = CountingService(ParameterShard(model, optimizer, placement, 0), TOKEN)
        server = rpc.server(max_workers=4)
        pb_grpc.add_ParameterServerServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        services.append(service)

        def client(**kwargs):
            clients.append(PSClient([f"127.0.0.1:{port}"], TOKEN, placement, **kwargs))
            return clients[-1]

        return service, client

    yield start
    for c in clients:
        c.close()
    for s in servers:
        s.stop(None)
    for s in services:
        s.close()


def ours() -> set[str]:
    return {f for f in os.listdir(push_slots.SHM_DIR) if f.startswith(f"elastic-step-ps0-{os.getpid()}-")}


def test_shared_pushes_apply_what_pushes_with_bytes_apply(serve):
    shared_service, shared_client = serve(keras.optimizers.Adam(0.01))
    bytes_service, bytes_client = serve(keras.optimizers.Adam(0.01))
    via_shm, via_bytes = shared_client(), bytes_client(shared_memory=False)
    rng = np.random.default_rng(0)
    for seq in range(6):
        g = rng.normal(size=shared_service.shard.dense_size).astype(np.float32)
        a_applied, [(a_version, a)] = via_shm.push(key(0, seq), [g], {})
        b_applied, [(b_version, b)] = via_bytes.push(key(0, seq), [g], {})
        assert a_applied and b_applied and a_version == b_version == seq + 1
        np.testing.assert_array_equal(a, b)
    assert len(shared_service.segments) == 1 and len(bytes_service.segments) == 0
    # Same host: rung through the doorbell, not one gRPC call; the other took one per push.
    assert shared_service.grpc_pushes == 0 and bytes_service.grpc_pushes == 6
    assert not ours()  # unlinked as soon as the shard mapped it: nothing to leak
    via_shm.close()
    assert len(shared_service.segments) == 0  # a clean close detaches


def test_a_push_of_several_minibatches_through_shared_slots_applies_what_bytes_apply(serve):
    shared_service, shared_client = serve(keras.optimizers.Adam(0.01))
    bytes_service, bytes_client = serve(keras.optimizers.Adam(0.01))
    via_shm, via_bytes = shared_client(), bytes_client(shared_memory=False)
    for c in (via_shm, via_bytes):
        c.reserve(2, minibatches=4)
    grads = np.random.default_rng(3).normal(size=(3, shared_service.shard.dense_size)).astype(np.float32)
    for c in (via_shm, via_bytes):
        assert c.push(key(2, 32, records=32), [grads[1]], {})[0]  # applied before: skipped below
    results = [c.push_many(key(2, 0, records=96), (0, 32, 64, 96), [grads]) for c in (via_shm, via_bytes)]
    for each, [(version, _values, shard_each)] in results:
        assert each == shard_each == [True, False, True] and version == 3
    np.testing.assert_array_equal(results[0][1][0][1], results[1][1][0][1])
    assert shared_service.grpc_pushes == 0 and bytes_service.grpc_pushes == 2  # rung through the doorbell


def test_a_replayed_key_is_skipped_and_returns_the_current_values(serve):
    service, client = serve(keras.optimizers.SGD(0.1))
    c = client()
    g = np.ones(service.shard.dense_size, np.float32)
    first, [(_, once)] = c.push(key(3, 128), [g], {})
    again, [(version, twice)] = c.push(key(3, 128), [g], {})
    assert first and not again and version == 1
    np.testing.assert_array_equal(once, twice)


def test_concurrent_pushes_each_use_their_own_slot(serve):
    # With SGD the final values are the initial ones minus lr * the sum of every gradient, in any
    # order: a gradient overwritten in a slot shared by two pushes would change the sum.
    service, client = serve(keras.optimizers.SGD(0.5))
    start = service.shard.dense_flat().copy()
    c = client(pushes_in_flight=2)
    rng = np.random.default_rng(1)
    grads = [rng.normal(size=service.shard.dense_size).astype(np.float32) for _ in range(60)]

    def pusher(offset):
        for i in range(offset, len(grads), 2):
            assert c.push(key(1, i), [grads[i]], {})[0]

    threads = [threading.Thread(target=pusher, args=(o,)) for o in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert service.shard.version == len(grads)
    np.testing.assert_allclose(service.shard.dense_flat(), start - 0.5 * np.sum(grads, axis=0), rtol=1e-4, atol=1e-5)


def test_a_dropped_segment_is_resent_with_bytes_and_applied_once(serve):
    service, client = serve(keras.optimizers.SGD(0.1))
    c = client()
    g = np.ones(service.shard.dense_size, np.float32)
    assert c.push(key(0, 0), [g], {})[0]
    (segment,) = list(service.segments._segments)
    service.segments.detach(segment)  # as when a shard drops its least recently used segment
    applied, [(version, values)] = c.push(key(0, 64), [g], {})
    assert applied and version == 2 and service.shard.version == 2
    np.testing.assert_array_equal(values, service.shard.dense_flat())


def test_a_segment_the_shard_cannot_verify_is_refused_and_bytes_are_sent(serve, monkeypatch, caplog):
    # What another host (or another pod's /dev/shm) looks like to the shard: not the worker's segment.
    created = push_slots.PushSlots.__init__

    def namesake(self, *args, **kwargs):
        created(self, *args, **kwargs)
        self.nonce = bytes(len(self.nonce))

    monkeypatch.setattr(push_slots.PushSlots, "__init__", namesake)
    service, client = serve(keras.optimizers.SGD(0.1))
    c = client()
    g = np.ones(service.shard.dense_size, np.float32)
    with caplog.at_level("INFO", logger="elastic_step.ps"):
        applied, [(_, values)] = c.push(key(0, 0), [g], {})
    assert applied and len(service.segments) == 0 and "refused shared push slots" in caplog.text
    np.testing.assert_array_equal(values, service.shard.dense_flat())
    assert not ours()


def test_the_shard_drops_its_least_recently_used_segment_beyond_its_bound():
    segments = push_slots.SharedSegments(max_segments=2)
    made = [push_slots.PushSlots(4, 1, tag="ps0") for _ in range(3)]
    try:
        first, second = (segments.attach(s.path, s.nonce, 4, 1) for s in made[:2])
        segments.slot(first, 0)  # used: the second is now the least recent
        third = segments.attach(made[2].path, made[2].nonce, 4, 1)
        assert len(segments) == 2
        segments.slot(first, 0)
        segments.slot(third, 0)
        with pytest.raises(KeyError):
            segments.slot(second, 0)
    finally:
        for s in made:
            s.close()


def test_only_our_segments_under_dev_shm_are_mapped(tmp_path):
    segments = push_slots.SharedSegments()
    with pytest.raises(ValueError, match="not an elastic-step segment"):
        segments.attach("/etc/passwd", b"x" * 16, 4, 1)
    with pytest.raises(ValueError, match="cannot open"):
        segments.attach(os.path.join(push_slots.SHM_DIR, "elastic-step-gone"), b"x" * 16, 4, 1)
    target = tmp_path / "elsewhere"
    target.write_bytes(bytes(push_slots.HEADER + 32))
    link = os.path.join(push_slots.SHM_DIR, f"elastic-step-link-{os.getpid()}")
    os.symlink(target, link)
    try:
        with pytest.raises(ValueError, match="cannot open"):  # a link is never followed
            segments.attach(link, bytes(16), 4, 1)
    finally:
        os.unlink(link)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["doorbell", "grpc"])
def test_a_fenced_launch_s_pushes_are_refused_whichever_way_they_come(serve, shared_memory):
    from elastic_step.instance.api import fenced

    service, client = serve(keras.optimizers.SGD(0.1))
    zombie, successor = (
        client(shared_memory=shared_memory, pusher=(1, 1)),
        client(shared_memory=shared_memory, pusher=(1, 2)),
    )
    g = np.ones(service.shard.dense_size, np.float32)
    assert zombie.push(key(3, 0), [g], {})[0]  # not fenced yet
    master = PSClient([zombie.addresses[0]], TOKEN)  # as the master tells the shards
    try:
        assert master.fence(1, 1, timeout=10) == []
    finally:
        master.close()
    with pytest.raises(Exception) as refused:
        zombie.push(key(3, 64), [g], {})
    assert fenced(refused.value).startswith("fenced: worker-1 launch 1 was given up by the master")
    assert service.shard.fences.refused == 1 and service.shard.version == 1
    assert successor.push(key(3, 64), [g], {})[0] and service.shard.version == 2  # its remainder, from the successor
    assert (service.grpc_pushes == 0) == shared_memory  # the way asked for
