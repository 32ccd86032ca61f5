"""The ring AllReduce over its transport, with payloads through shared-memory lanes and over TCP: exact sums,
the same bits on every member, and the ways an attempt ends early (a version change, a dead peer, a wrong
token, stale frames of an older step)."""

from __future__ import annotations

import gc
import glob
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from elastic_step.ps.push_slots import PushSlots
from elastic_step.util import shared_memory
from elastic_step.worker.allreduce import collective, ring_lane, ring_transport
from elastic_step.worker.allreduce.collective import PIECE_VALUES, Aborted, PeerFailed

TOKEN = "test-token"
LANE_VALUES = ring_lane.INITIAL_BYTES // 4  # a lane grows past it


class Member:
    """A worker's ring side in this process: its Ring, and the gRPC server that tells peers its port."""

    def __init__(self, name: str, token: str = TOKEN, shared_memory: bool = True, host: str = "127.0.0.1"):
        self.name = name
        self.ring = collective.Ring(token, name, host, shared_memory)
        self.server, port = collective.serve(
            collective.CollectiveService(token, collective.StateProvider(), self.ring.port), host
        )
        self.address = f"{host}:{port}"

    def close(self) -> None:
        self.ring.close()
        self.server.stop(0)


def lane_files() -> set[str]:
    """This process's lane files: the suite runs on several workers, whose rings make lanes of their own."""
    return set(glob.glob(os.path.join(shared_memory.SHM_DIR, f"elastic-step-ring-{os.getpid()}-*")))


def mapped_lanes() -> list[str]:
    """This process's mappings of lane files, as the kernel lists them."""
    with open("/proc/self/maps") as f:
        return [line for line in f if "elastic-step-ring-" in line]


@pytest.fixture(params=[True, False], ids=["lane", "tcp"])
def members(request):
    """Members whose links offer a shared-memory lane (all on this host, so they use it), or not."""
    made: list[Member] = []
    files_before = lane_files()

    def make(n: int, prefix: str = "worker") -> list[Member]:
        new = [Member(f"{prefix}-{len(made) + i}", shared_memory=request.param) for i in range(n)]
        made.extend(new)
        return new

    make.shared = request.param
    yield make
    for m in made:
        m.close()
    assert lane_files() <= files_before, "a lane's file outlived the hello"


def never_abort() -> None:
    pass


def on_threads(n: int, run) -> None:
    """run(i) for i in range(n), each on a thread of its own, as each member in a process of its own."""
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an allreduce hung"


def allreduce_all(
    ms: list[Member], bufs: list[np.ndarray], version: int, step: int, checks: list | None = None
) -> list:
    """Every member's allreduce at once, each on its own thread: its result, or the exception it raised."""
    ring = [(m.name, m.address) for m in ms]
    results: list = [None] * len(ms)

    def run(i: int) -> None:
        try:
            results[i] = ms[i].ring.allreduce(bufs[i], ring, version, step, checks[i] if checks else never_abort)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            results[i] = e

    on_threads(len(ms), run)
    return results


def ring_order_sum(bufs: list[np.ndarray]) -> np.ndarray:
    """The ring's sum to the bit: chunk c is accumulated starting at member c, then c+1, ... around."""
    n, size = len(bufs), bufs[0].size
    bounds = np.linspace(0, size, n + 1).astype(np.int64)
    out = np.empty(size, np.float32)
    for c in range(n):
        lo, hi = bounds[c], bounds[c + 1]
        acc = bufs[c][lo:hi].copy()
        for k in range(1, n):
            acc = bufs[(c + k) % n][lo:hi] + acc
        out[lo:hi] = acc
    return out


# The last two grow each lane past its first size.
@pytest.mark.parametrize(
    "n, size",
    [
        (2, 1000),
        (3, 3 * PIECE_VALUES + 17),
        (4, 5 * PIECE_VALUES // 2),
        (3, 2),
        (2, 3 * LANE_VALUES + 123),
        (3, 2 * LANE_VALUES + 7),
    ],
)
def test_every_member_ends_with_the_same_bits_of_the_sum(members, n, size):
    ms = members(n)
    rng = np.random.default_rng(n * size)
    bufs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    results = allreduce_all(ms, bufs, 1, 0)
    expected = ring_order_sum(bufs)
    for r in results:
        assert isinstance(r, np.ndarray), r
        assert r.tobytes() == expected.tobytes()
    np.testing.assert_allclose(results[0], np.sum(bufs, axis=0), rtol=1e-5, atol=1e-5)
    # Integers stay exact whatever the order of the additions: the sum is numpy's, exactly.
    ints = [rng.integers(-1000, 1000, size).astype(np.float32) for _ in range(n)]
    for r in allreduce_all(ms, ints, 1, 1):
        assert np.array_equal(r, np.sum(ints, axis=0))


def test_a_ring_re_forms_without_a_lost_member_and_with_a_newcomer(members):
    a, b, c = members(3)
    ones = [np.full(PIECE_VALUES + 5, float(i + 1), np.float32) for i in range(3)]
    assert all(np.all(r == 6) for r in allreduce_all([a, b, c], ones, 1, 0))
    c.close()
    assert all(np.all(r == 3) for r in allreduce_all([a, b], ones[:2], 2, 0))
    newcomer = Member("worker-2")  # c relaunched: same name, another address
    try:
        assert all(np.all(r == 6) for r in allreduce_all([b, newcomer, a], [ones[1], ones[2], ones[0]], 3, 1))
    finally:
        newcomer.close()


def test_a_neighbour_that_sent_to_another_member_meanwhile_is_not_taken_for_dead(members):
    a, c, b = members(3)
    ones = [np.full(1000, float(i + 1), np.float32) for i in range(3)]
    assert all(np.all(r == 3) for r in allreduce_all([a, c], ones[:2], 1, 0))  # c sends to a
    assert all(np.all(r == 6) for r in allreduce_all([a, c, b], ones, 2, 1))  # c sends to b
    b.close()
    results = allreduce_all([a, c], ones[:2], 3, 1)  # c sends to a again
    assert all(isinstance(r, np.ndarray) and np.all(r == 3) for r in results), results


def aborts_after(calls: int):
    """An abort_check that finds the membership changed on its `calls`-th call."""
    seen = [0]

    def check() -> None:
        seen[0] += 1
        if seen[0] >= calls:
            raise Aborted("membership is now version 2")

    check.seen = seen
    return check


def test_a_version_change_aborts_a_member_waiting_for_its_neighbour(members):
    a, b = members(2)
    check = aborts_after(3)
    buf = np.ones(10, np.float32)
    # b never takes part: a sends, then waits for b's frames and polls abort_check meanwhile.
    with pytest.raises(Aborted):
        a.ring.allreduce(buf, [(a.name, a.address), (b.name, b.address)], 1, 0, check)
    assert check.seen[0] == 3


@pytest.mark.parametrize("size", [3 * PIECE_VALUES, 3 * LANE_VALUES + 5])
def test_frames_of_an_aborted_step_are_never_mixed_into_the_next(members, size):
    a, b = members(2)
    ring = [(a.name, a.address), (b.name, b.address)]
    stale = np.full(size, 1e6, np.float32)
    # a's attempt at (1, 5) sends its chunk to b, then is aborted: b never took part in version 1. Through a
    # lane, a writes its retry's values where the stale frames point: b must skip them, never read them.
    with pytest.raises(Aborted):
        a.ring.allreduce(stale, ring, 1, 5, aborts_after(2))
    # Version 2 retries step 5 with other values; b's connection still holds a's stale frames.
    bufs = [np.full(size, 1.0, np.float32), np.full(size, 2.0, np.float32)]
    results = allreduce_all([a, b], bufs, 2, 5)
    for r in results:
        assert isinstance(r, np.ndarray), r
        assert np.all(r == 3.0)


def test_a_left_neighbour_ahead_aborts_the_attempt_and_its_frames_wait_for_the_next(members):
    a, b = members(2)
    ring = [(a.name, a.address), (b.name, b.address)]
    results: list = []
    # b is already at version 2 while a still runs version 1: a aborts, then retries at version 2.
    t = threading.Thread(
        target=lambda: results.append(b.ring.allreduce(np.full(7, 2.0, np.float32), ring, 2, 0, never_abort))
    )
    t.start()
    with pytest.raises(Aborted, match="moved on to version 2"):
        a.ring.allreduce(np.full(7, 1.0, np.float32), ring, 1, 0, never_abort)
    mine = a.ring.allreduce(np.full(7, 1.0, np.float32), ring, 2, 0, never_abort)
    t.join(30)
    assert np.all(mine == 3.0) and np.all(results[0] == 3.0)


def test_an_interrupted_attempt_is_not_resumed_before_the_membership_moves_on(members):
    a, b = members(2)
    ring = [(a.name, a.address), (b.name, b.address)]
    with pytest.raises(Aborted):
        a.ring.allreduce(np.ones(10, np.float32), ring, 1, 0, aborts_after(2))
    check = aborts_after(4)
    with pytest.raises(Aborted, match="version 2"):
        a.ring.allreduce(np.ones(10, np.float32), ring, 1, 0, check)
    assert check.seen[0] == 4  # it waited for abort_check to say so, and took no frame meanwhile


def test_a_connection_without_the_job_token_is_refused(members):
    (a,) = members(1)
    with pytest.raises(PeerFailed, match="wrong job token"):
        ring_transport.connect(a.name, "127.0.0.1", a.ring.port, "not-the-token", ("intruder", "127.0.0.1:1"))
    with socket.create_connection(("127.0.0.1", a.ring.port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert s.recv(100).startswith(ring_transport.REFUSED)
    assert a.ring.listener.links == {}  # nothing from either is read as ring data
    # A member of another job (another token) is refused by the gRPC service already.
    other = Member("worker-9", token="another-job")
    try:
        with pytest.raises(PeerFailed, match="UNAUTHENTICATED"):
            other.ring.allreduce(
                np.ones(4, np.float32), [(other.name, other.address), (a.name, a.address)], 1, 0, never_abort
            )
    finally:
        other.close()


def test_a_ring_connection_of_a_launch_older_than_one_that_connected_is_refused_and_its_open_one_closed(members):
    (a,) = members(1)
    listener, token = a.ring.listener, TOKEN
    zombie = ring_transport.connect(a.name, "127.0.0.1", a.ring.port, token, ("worker-1", "127.0.0.1:1"), launch=1)
    successor = ring_transport.connect(a.name, "127.0.0.1", a.ring.port, token, ("worker-1", "127.0.0.1:2"), launch=2)
    try:
        deadline = time.monotonic() + 10
        while ("worker-1", "127.0.0.1:2") not in listener.links and time.monotonic() < deadline:
            time.sleep(0.01)
        # The successor's connection closed the zombie's (its frames are never read), and the zombie cannot connect
        # again: what it sends after it was given up is refused, not merely left unread.
        assert list(listener.links) == [("worker-1", "127.0.0.1:2")] and listener.fenced_refused == 1
        with pytest.raises(PeerFailed, match="fenced: worker-1 launch 1: launch 2 of it joined the ring since"):
            ring_transport.connect(a.name, "127.0.0.1", a.ring.port, token, ("worker-1", "127.0.0.1:1"), launch=1)
        assert listener.fenced_refused == 2
        # A hello that names no launch, as before launches: never refused.
        ring_transport.connect(a.name, "127.0.0.1", a.ring.port, token, ("worker-1", "127.0.0.1:3")).close()
    finally:
        zombie.close()
        successor.close()


PEER = """
import sys, numpy as np
from elastic_step.faults.process import install_worker_faults
from elastic_step.worker.allreduce import collective
me, address_file, ring_file = sys.argv[1:]
install_worker_faults(me)
ring = collective.Ring("test-token", me, "127.0.0.1")
server, port = collective.serve(collective.CollectiveService("test-token", collective.StateProvider(), ring.port),
                                "127.0.0.1")
open(address_file, "w").write(f"127.0.0.1:{port}")
import time, os
while not os.path.exists(ring_file):
    time.sleep(0.05)
members = [tuple(line.split()) for line in open(ring_file).read().splitlines()]
ring.allreduce(np.ones(4 * collective.PIECE_VALUES, np.float32), members, 1, 7, lambda: None)
"""


def test_a_peer_killed_in_the_middle_of_a_collective_is_a_peer_failure_not_a_hang(members, tmp_path):
    (a,) = members(1)
    address_file, ring_file = tmp_path / "address", tmp_path / "ring"
    env = dict(os.environ, ELASTIC_STEP_COLLECTIVE_CHAOS="worker-1@step=7")  # SIGKILL after its first chunk
    peer = subprocess.Popen([sys.executable, "-c", PEER, "worker-1", str(address_file), str(ring_file)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not (address_file.exists() and address_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        ring_file.write_text(f"{a.name} {a.address}\nworker-1 {address_file.read_text()}\n")
        members_ = [(a.name, a.address), ("worker-1", address_file.read_text())]
        with pytest.raises(PeerFailed) as failed:
            a.ring.allreduce(np.ones(4 * PIECE_VALUES, np.float32), members_, 1, 7, never_abort)
        assert failed.value.peer == "worker-1"
        assert peer.wait(30) == -9
    finally:
        peer.kill()


def mapped_file(a: np.ndarray) -> int:
    """The inode of the file mapped where `a` lies, as the kernel lists this process's mappings."""
    address = a.__array_interface__["data"][0]
    for line in mapped_lanes():
        span, _, _, _, inode, *_ = line.split()
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return int(inode)
    raise AssertionError(f"{address:#x} lies in no lane's file")


def test_members_on_one_host_move_payloads_through_shared_memory_that_dies_with_them(members):
    before = set(mapped_lanes())
    a, b, c = members(3)
    for step in range(2):
        bufs = [np.full(3 * PIECE_VALUES, float(i + 1 + step), np.float32) for i in range(3)]
        results = allreduce_all([a, b, c], bufs, 1, step)
        assert all(np.all(r == 6 + 3 * step) for r in results)
    links = [m.ring._links[key] for m in (a, b, c) for key in m.ring._links]
    # The kernel's list of this process's mappings: both ends of the 3 links, and the ring's shared
    # result once per member, their files already unlinked.
    maps = [line for line in mapped_lanes() if line not in before]
    if members.shared:
        assert all(link.lane is not None for link in links)
        assert len(maps) == 9 and all(line.rstrip().endswith("(deleted)") for line in maps), maps
        # From the second step on the members' results are one and the same memory: all three map it.
        (shared,) = {mapped_file(r) for r in results}
        assert sum(int(line.split()[4]) == shared for line in maps) == 3
    else:
        assert all(link.lane is None for link in links) and maps == []
    del results  # a result keeps its mapping
    for m in (a, b, c):
        m.close()
    deadline = time.monotonic() + 10
    while set(mapped_lanes()) - before and time.monotonic() < deadline:  # unmapped as their last views go
        gc.collect()
        time.sleep(0.05)
    assert set(mapped_lanes()) - before == set()


def test_a_ring_partly_over_tcp_shares_its_result_only_where_it_can_and_leaves_no_file():
    # worker-1 offers no lane, as if worker-2 were on another host: the shared result named by worker-0
    # stops at worker-1, and a member working in it and one working in its lane agree on every bit.
    files_before = lane_files()
    ms = [Member("worker-0"), Member("worker-1", shared_memory=False), Member("worker-2")]
    try:
        for step in range(4):
            bufs = [np.arange(2 * PIECE_VALUES + 7, dtype=np.float32) * (i + 1 + step) for i in range(3)]
            results = allreduce_all(ms, bufs, 1, step)
            expected = bufs[0] + bufs[1] + bufs[2]
            assert all(np.array_equal(r, results[0]) for r in results) and np.allclose(results[0], expected)
        assert ms[0].ring._shared is not None and ms[1].ring._shared is not None and ms[2].ring._shared is None
        assert ms[0].ring._shared.segment.path in lane_files()  # its name never came back
    finally:
        for m in ms:
            m.close()
    assert lane_files() <= files_before, "the shared result's file outlived the ring"


def test_a_neighbour_that_cannot_see_the_lane_gets_payloads_over_tcp(members, tmp_path, monkeypatch):
    # A lane made where the receiver does not look, as on another host or in another pod: the hello's
    # answer says so, the link sends payloads over TCP, and the sender's file is gone.
    create = ring_lane.Lane.create
    monkeypatch.setattr(ring_lane.Lane, "create", classmethod(lambda cls: create.__func__(cls, str(tmp_path))))
    before = set(mapped_lanes())
    a, b = members(2)
    bufs = [np.arange(2 * PIECE_VALUES + 3, dtype=np.float32) * (i + 1) for i in range(2)]
    assert all(np.array_equal(r, bufs[0] * 3) for r in allreduce_all([a, b], bufs, 1, 0))
    assert all(link.lane is None for m in (a, b) for link in m.ring._links.values())
    assert list(tmp_path.iterdir()) == [] and set(mapped_lanes()) <= before


def test_a_lane_name_is_only_ever_looked_up_among_our_segments_in_shared_memory():
    for name in ("../etc/passwd", "/etc/passwd", "elastic-step-ring-gone"):
        assert ring_lane.Lane.attach(name) is None
    # Another of our segments (a PS's push slots) is neither mapped as a lane nor unlinked.
    slots = PushSlots(4, 1, tag="ps0")
    try:
        assert ring_lane.Lane.attach(os.path.basename(slots.path)) is None and os.path.exists(slots.path)
    finally:
        slots.close()


def test_a_peer_at_another_address_is_not_offered_a_lane():
    # As pods are, each at an address of its own: the link sends payloads over TCP and makes no segment.
    before = set(mapped_lanes())
    a, b = Member("worker-0"), Member("worker-1", host="127.0.0.2")
    try:
        bufs = [np.full(PIECE_VALUES + 9, float(i + 1), np.float32) for i in range(2)]
        assert all(np.all(r == 3) for r in allreduce_all([a, b], bufs, 1, 0))
        assert all(link.lane is None for m in (a, b) for link in m.ring._links.values())
        assert set(mapped_lanes()) <= before
    finally:
        a.close()
        b.close()


def test_a_result_is_read_only_and_holds_until_the_next_allreduce(members):
    # Through a lane the result is in the lane, which the right neighbour reads: no caller may write it,
    # and every step's result is whole although the values change every step.
    ms = members(3)
    for step in range(12):
        bufs = [np.full(2 * PIECE_VALUES + 3, float(step * 10 + i), np.float32) for i in range(3)]
        results = allreduce_all(ms, bufs, 1, step)
        for r in results:
            assert isinstance(r, np.ndarray), r
            assert np.all(r == 30 * step + 3), (step, np.unique(r))
            assert not r.flags.writeable
            with pytest.raises(ValueError):
                r[0] = 0


@pytest.mark.parametrize("steps", [range(8), (0, 1, 3, 5, 6, 8, 9, 11)], ids=["consecutive", "with-gaps"])
def test_a_neighbour_still_reading_a_step_is_not_overwritten_by_the_next(members, monkeypatch, steps):
    # Each member runs its steps back to back (`on_threads`), and worker-1 reads worker-0's all-gather
    # pieces late: worker-0, in its next step by then, writes its lane first where its own chunk goes,
    # the piece worker-1 reads last. It must write elsewhere. In the ring's shared result too, where
    # steps s and s + 2 with none between them would take the same buffer.
    ms = members(3)
    payload = ring_transport.InLink.payload

    def late(link: ring_transport.InLink, into: np.ndarray, wait) -> None:
        if link.peer == ms[0].name:
            time.sleep(0.02)
        payload(link, into, wait)

    monkeypatch.setattr(ring_transport.InLink, "payload", late)
    ring = [(m.name, m.address) for m in ms]
    outcomes: list = []

    def run(i: int) -> None:
        try:
            for step in steps:
                buf = np.full(2 * PIECE_VALUES + 3, float(step * 10 + i), np.float32)
                r = ms[i].ring.allreduce(buf, ring, 1, step, never_abort)
                outcomes.append((i, step, np.unique(r).tolist()))
        except Exception as e:  # noqa: BLE001 - the test looks at it
            outcomes.append((i, e))

    on_threads(3, run)
    assert sorted(outcomes) == [(i, step, [30 * step + 3.0]) for i in range(3) for step in steps]


def test_a_lane_places_each_step_clear_of_what_its_receiver_may_still_read():
    lane = ring_lane.Lane.create()
    try:
        size = LANE_VALUES // 2
        # Steps that succeed take turns between two places: two buffers' worth of lane.
        origins = []
        for _ in range(4):
            origins.append(lane.claim(size)[0])
            lane.settled()
        assert origins == [0, size, 0, size] and lane.nbytes == 4 * 2 * size
        # Aborted attempts keep their places until one succeeds: the receiver may still read any of them.
        assert lane.claim(size) == (0, False)  # aborted
        assert lane.claim(size) == (2 * size, True)  # aborted too: clear of both, the lane grew
        assert lane.claim(size)[0] == 3 * size  # succeeds
        lane.settled()
        assert lane.claim(size)[0] == 0
        lane.settled()
        # A larger buffer goes past the place still read, if need be.
        assert lane.claim(3 * size) == (size, False) and lane.nbytes == 4 * 4 * size
    finally:
        lane.unlink()
        lane.close()


def test_a_lane_grows_with_the_buffer_and_its_receiver_follows(members):
    ms = members(2)
    for step, size in enumerate([1000, LANE_VALUES + 1, 3 * LANE_VALUES + 5, 1000]):
        bufs = [np.arange(size, dtype=np.float32) * (i + 1) for i in range(2)]
        assert all(np.array_equal(r, bufs[0] * 3) for r in allreduce_all(ms, bufs, 1, step))
    if members.shared:
        for m in ms:
            (out,) = m.ring._links.values()
            (into,) = m.ring.listener.links.values()
            assert out.lane.nbytes >= 4 * (3 * LANE_VALUES + 5) and into.lane.nbytes == out.lane.nbytes


def test_a_lane_that_cannot_grow_hands_its_link_over_to_tcp(members, monkeypatch, caplog):
    # A full /dev/shm when a larger buffer comes: the sender says so in the stream and both sides go on
    # over TCP, with nobody taken for dead.
    ms = members(2)
    small = [np.full(1000, float(i + 1), np.float32) for i in range(2)]
    assert all(np.all(r == 3) for r in allreduce_all(ms, small, 1, 0))

    def full(fd: int, size: int, directory: str = shared_memory.SHM_DIR) -> None:
        raise shared_memory.SharedMemoryUnavailable(f"cannot reserve {size} bytes in {directory}: No space left")

    monkeypatch.setattr(shared_memory, "reserve", full)
    big = [np.arange(2 * LANE_VALUES, dtype=np.float32) * (i + 1) for i in range(2)]
    assert all(np.array_equal(r, big[0] * 3) for r in allreduce_all(ms, big, 1, 1))
    assert all(np.all(r == 3) for r in allreduce_all(ms, small, 1, 2))
    assert all(link.lane is None for m in ms for link in [*m.ring._links.values(), *m.ring.listener.links.values()])
    if members.shared:
        assert "payloads go over TCP from now on" in caplog.text


def test_a_frame_outside_the_lane_is_refused():
    lane = ring_lane.Lane.create()
    try:
        assert lane.piece(0, 8).size == 8
        for offset, count in ((LANE_VALUES - 4, 8), (-1, 2), (LANE_VALUES, 1)):
            with pytest.raises(ValueError, match="outside the lane"):
                lane.piece(offset, count)
    finally:
        lane.unlink()
        lane.close()
