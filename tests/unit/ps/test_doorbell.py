"""The doorbell protocol on real Unix sockets: admission by nonce, answers, drops, failures, shutdown."""

from __future__ import annotations

import os
import socket

import pytest

from elastic_step.ps import doorbell, push_slots
from tests.unit.ps.keys import key

NONCE = b"n" * 16


@pytest.fixture
def server():
    """A doorbell whose shard holds segment 7 (2 slots) and records each push it is rung for."""
    rung, made = [], []

    def admit(segment, slot, nonce):
        return segment == 7 and 0 <= slot < 2 and nonce == NONCE

    def push(segment, slot, key, want_dense, bounds, state_base):
        if key.seq < 0:
            raise doorbell.Dropped()
        if key.seq == 999:
            raise RuntimeError("the optimizer blew up")
        rung.append(
            (segment, slot, key, want_dense)
            + ((bounds,) if bounds else ())
            + ((state_base,) if state_base is not None else ())
        )
        if bounds:  # a push of several minibatches: the odd-numbered ones were applied before
            each = [i % 2 == 0 for i in range(len(bounds) - 1)]
            return any(each), len(rung), each
        applied = key.idempotency not in {r[2].idempotency for r in rung[:-1]}
        return applied, len(rung), [applied]

    def start():
        made.append(doorbell.DoorbellServer(admit, push))
        return made[-1], rung

    yield start
    for s in made:
        s.close()


def test_a_ring_carries_the_key_and_returns_the_shards_answer(server):
    bell_server, rung = server()
    bell = doorbell.Bell(bell_server.address, 7, 1, NONCE, timeout=5)
    assert bell.ring(key(3, 128, epoch=2, data_shard=5), True) == (True, 1, [True])
    assert bell.ring(key(3, 128), False) == (False, 2, [False])  # the shard's answer, as it gave it
    # The whole key crosses: the records (for the audit) as well as the idempotency key.
    assert rung == [(7, 1, key(3, 128, epoch=2, data_shard=5), True), (7, 1, key(3, 128), False)]
    bell.close()


def test_a_ring_for_several_minibatches_carries_their_bounds_and_returns_each_ones_answer(server):
    bell_server, rung = server()
    bell = doorbell.Bell(bell_server.address, 7, 0, NONCE, timeout=5)
    bounds = tuple(range(0, 64 * 33, 64))  # 32 minibatches
    assert bell.ring(key(3, 0), True, bounds) == (True, 1, [i % 2 == 0 for i in range(32)])
    assert rung == [(7, 0, key(3, 0), True, bounds)]
    # A lone worker's push with its copy's state: the version it was computed from crosses (0 included).
    for base in (0, 41):
        bell.ring(key(4, 0), False, bounds, state_base=base)
        assert rung[-1] == (7, 0, key(4, 0), False, bounds, base)
    bell.close()


@pytest.mark.parametrize("segment, slot, nonce", [(7, 0, b"x" * 16), (8, 0, NONCE), (7, 2, NONCE)])
def test_a_connection_without_the_segments_nonce_is_refused(server, segment, slot, nonce):
    bell_server, rung = server()
    with pytest.raises(doorbell.PushFailed, match="not admitted"):
        doorbell.Bell(bell_server.address, segment, slot, nonce, timeout=5)
    assert rung == []


def test_a_dropped_segment_and_a_failed_push_are_told_apart(server):
    bell_server, _ = server()
    bell = doorbell.Bell(bell_server.address, 7, 0, NONCE, timeout=5)
    with pytest.raises(doorbell.PushFailed, match="RuntimeError: the optimizer blew up"):
        bell.ring(key(1, 999), True)
    assert bell.ring(key(1, 0), True) == (True, 1, [True])  # a failure leaves the connection usable
    with pytest.raises(doorbell.Dropped):
        bell.ring(key(1, -1), True)
    with pytest.raises(ConnectionError):  # after a drop the shard hangs up
        bell.ring(key(1, 64), True)
    bell.close()


def test_closing_the_server_wakes_its_connections_and_clients_see_it(server):
    bell_server, _ = server()
    bell = doorbell.Bell(bell_server.address, 7, 0, NONCE, timeout=5)
    bell_server.close()
    with pytest.raises((ConnectionError, OSError)):
        bell.ring(key(1, 0), True)
    bell.close()
    with pytest.raises(OSError):  # nothing listens any more
        doorbell.Bell(bell_server.address, 7, 0, NONCE, timeout=5)


def test_the_address_is_abstract_so_nothing_is_left_on_disk(server):
    bell_server, _ = server()
    assert bell_server.address.startswith("@")
    name = bell_server.address[1:]
    assert not os.path.exists(name) and not os.path.exists(os.path.join("/tmp", name))


def test_a_segments_nonce_admits_only_its_own_slots():
    segments = push_slots.SharedSegments()
    slots = push_slots.PushSlots(4, 2, tag="ps0")
    try:
        seg = segments.attach(slots.path, slots.nonce, 4, 2)
        assert segments.admits(seg, 0, slots.nonce) and segments.admits(seg, 1, slots.nonce)
        assert not segments.admits(seg, 2, slots.nonce)
        assert not segments.admits(seg, 0, bytes(16))
        assert not segments.admits(seg + 1, 0, slots.nonce)
        segments.detach(seg)
        assert not segments.admits(seg, 0, slots.nonce)
    finally:
        slots.close()


def test_garbage_on_the_socket_ends_only_that_connection(server):
    bell_server, rung = server()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    raw.settimeout(5)
    raw.connect("\0" + bell_server.address[1:])
    raw.send(b"hello?")
    assert raw.recv(4096)[:1] == bytes([doorbell.FAILED])
    raw.close()
    bell = doorbell.Bell(bell_server.address, 7, 0, NONCE, timeout=5)
    assert bell.ring(key(2, 0), True) == (True, 1, [True])
    bell.close()
