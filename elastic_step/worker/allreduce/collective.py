"""Ring AllReduce between workers, and the worker's Collective service.

N members, one flat float32 buffer split into N chunks: N-1 reduce-scatter rounds, then N-1
all-gather rounds. A member sends to its right neighbour and receives from its left one over TCP
(ring_transport.py: raw float32 frames keyed (version, step, phase, round, offset), read straight
into numpy memory), or, between neighbours on one host, through a shared-memory lane (ring_lane.py):
there the member's output buffer is the lane, and its right neighbour reads each piece where it lies,
told by a header over TCP. When every link is a lane, the members share one result (ring_result.py):
chunks are reduced in place there and the all-gather copies nothing. Chunks travel as pieces of
PIECE_VALUES, pipelined: a member forwards each piece as soon as it has added its own values to it
(reduce-scatter) or copied it (all-gather), while its left neighbour computes the next. Bandwidth, not
per-message overhead, bounds a large buffer.

Every member ends with bitwise the same sum: each chunk is reduced once, by one member, then
copied around the ring. A wait polls for an abort every ~50 ms (`abort_check`: the master's
membership version changed); a neighbour whose connection fails, or that neither sends nor takes
data for PEER_TIMEOUT_S, raises `PeerFailed`. Either way the caller discards the partial result:
nothing of an aborted step is applied, and an interrupted (version, step) is never resumed (its
frames may still be in flight): the retry waits for the next membership version.

The gRPC server answers `RingEndpoint` (the port of the member's ring listener, asked once per
peer) and `PullState`: a newcomer asks a live peer for every model weight and optimizer variable
once that peer has applied a given step (instance/collective_client.py is its client).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

from elastic_step import fault_hooks as faults
from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import elastic_pb2_grpc as pb_grpc
from elastic_step.proto import rpc, tensors
from elastic_step.proto.rpc import check_token
from elastic_step.worker.allreduce.ring_result import SharedResult
from elastic_step.worker.allreduce.ring_transport import (
    PEER_TIMEOUT_S,
    POLL_S,
    Aborted,
    InLink,
    OutLink,
    PeerFailed,
    RingListener,
    connect,
)

__all__ = ["Aborted", "PeerFailed", "StateProvider", "CollectiveService", "serve", "Ring"]

log = logging.getLogger("elastic_step.worker")

PIECE_VALUES = 1 << 20  # float32 values per frame (4 MB: fewer frames, system calls and wake-ups per step; see README)


class StateProvider:
    """What PullState serves: the worker's applied step and a snapshot of its variables."""

    def __init__(self, snapshot: Callable[[], tuple[int, list[np.ndarray], dict]] | None = None) -> None:
        """`snapshot`: () -> (number of model weights, weights then optimizer variables, the records they hold);
        None: no state to serve (PullState answers UNAVAILABLE)."""
        self.cv = threading.Condition()
        self.applied_step = -1
        self.snapshot = snapshot

    def set_applied(self, step: int) -> None:
        with self.cv:
            self.applied_step = step
            self.cv.notify_all()


class CollectiveService(pb_grpc.CollectiveServicer):
    def __init__(self, token: str, state: StateProvider, ring_port: int):
        self.token, self.state, self.ring_port = token, state, ring_port

    def RingEndpoint(self, request, context):
        check_token(context, self.token, request.token)
        return pb.RingEndpointReply(port=self.ring_port)

    def PullState(self, request, context):
        check_token(context, self.token, request.token)
        st = self.state
        with st.cv:
            if request.step >= 0:
                st.cv.wait_for(lambda: st.applied_step >= request.step or not context.is_active(), 30.0)
                if st.applied_step != request.step:
                    context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"peer is at step {st.applied_step}, asked for {request.step}",
                    )
            if st.snapshot is None:
                context.abort(grpc.StatusCode.UNAVAILABLE, "no state yet")
            # Under the lock: the owner applies a step only while holding it, so this is one step's state.
            num_model, values, applied = st.snapshot()
            step = st.applied_step
        return tensors.state_reply(tensors.MemberState(step, num_model, values, applied))


def serve(service: CollectiveService, host: str) -> tuple[grpc.Server, int]:
    server = rpc.server(max_workers=16)
    pb_grpc.add_CollectiveServicer_to_server(service, server)
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    return server, port


class Ring:
    """This member's side of the ring: its ring listener, its links to right neighbours, and the
    ports of its peers' listeners (asked once per peer). `shared_memory`: offer a right neighbour at
    this member's own host address a shared-memory lane (used if it is on this host)."""

    def __init__(self, token: str, me: str, host: str, shared_memory: bool = True, launch: int = 0):
        """`launch`: this process's launch of `me` (instance/api.py, LAUNCH_ENV), which its ring hellos name."""
        self.token, self.me, self.shared_memory, self.launch = token, me, shared_memory, launch
        self.listener = RingListener(token, host)
        self.port = self.listener.port
        # (name, gRPC address) -> OutLink. A link to a peer that is no longer the right neighbour stays
        # open: closing it would read, on that peer's side, like this member's death (its listener may
        # hand the closed connection to a later version in which this member is its left neighbour).
        self._links: dict[tuple[str, str], OutLink] = {}
        self._ports: dict[str, int] = {}  # gRPC address -> ring port
        self._begun = (-1, -1)  # the newest (version, step) attempted
        self._succeeded = (-1, -1)  # the newest (version, step) that succeeded
        self._shared: SharedResult | None = None  # the ring's shared result, for one version

    def _link_to(self, peer: str, address: str, me: tuple[str, str]) -> OutLink:
        link = self._links.get((peer, address))
        if link is not None and link.failure is None:
            return link
        for key in [k for k in self._links if k[0] == peer]:  # failed, or an earlier incarnation's
            self._links.pop(key).close()
        if address not in self._ports:
            ch = rpc.channel(address)
            try:
                self._ports[address] = (
                    pb_grpc.CollectiveStub(ch).RingEndpoint(pb.RingEndpointRequest(token=self.token), timeout=10).port
                )
            except grpc.RpcError as e:
                raise PeerFailed(peer, f"RingEndpoint: {e.code().name}: {e.details()}") from e
            finally:
                ch.close()
        host = rpc.host_of(address)
        # A lane is offered only to a peer at this member's own address: pods each have an address (and a
        # /dev/shm) of their own, and would only make and drop one.
        shared = self.shared_memory and host == rpc.host_of(me[1])
        try:
            link = connect(peer, host, self._ports[address], self.token, me, shared, self.launch)
        except PeerFailed:
            del self._ports[address]  # a relaunched peer at the same address listens elsewhere
            raise
        self._links[(peer, address)] = link
        return link

    def allreduce(
        self, buf: np.ndarray, members: list[tuple[str, str]], version: int, step: int, abort_check: Callable[[], None]
    ) -> np.ndarray:
        """The element-wise SUM of every member's `buf` (float32, same size everywhere), read-only. It
        holds until this Ring's next allreduce (through a lane it is in the lane: copy it to keep it)."""
        n = len(members)
        if n == 1:
            alone = np.array(buf, dtype=np.float32, copy=True)
            alone.flags.writeable = False
            return alone
        mine = np.ascontiguousarray(buf, dtype=np.float32)  # only read, until this returns
        key = (version, step)
        if key <= self._begun:
            self._await_new_version(key, abort_check)
        self._begun = key
        rank = [name for name, _ in members].index(self.me)
        left = members[rank - 1]
        right = self._link_to(*members[(rank + 1) % n], members[rank])
        out = right.output(mine.size, self._shared_buffer(key, rank, right, mine.size))
        started = time.monotonic()

        def waiting_on(peer: str, last_progress: Callable[[], float]) -> Callable[[], None]:
            def wait() -> None:
                right.check()
                abort_check()
                if time.monotonic() - max(started, last_progress()) > PEER_TIMEOUT_S:
                    raise PeerFailed(peer, f"neither sent nor took ring data for {PEER_TIMEOUT_S:.0f} s")

            return wait

        from_left = self.listener.link_from(left, waiting_on(left[0], lambda: started))
        receiving = waiting_on(left[0], lambda: from_left.last_progress)
        bounds = [out.size * i // n for i in range(n + 1)]

        def pieces(a: np.ndarray, i: int) -> list[tuple[int, np.ndarray]]:
            """Chunk i of `a` in pieces, each with the place of its first value in the buffer."""
            end = bounds[i + 1]
            return [(o, a[o : min(o + PIECE_VALUES, end)]) for o in range(bounds[i], end, PIECE_VALUES)]

        try:
            # Chunk `rank` goes out as it is and comes back summed; each other one is received once in the
            # reduce-scatter, added to this member's values into `out`: `out` needs no copy of `buf` first.
            # Through a lane, what the right neighbour reads is `out`: this chunk is put there first.
            through_lane = right.lane is not None
            for (offset, piece), (_, own) in zip(pieces(out, rank), pieces(mine, rank)):
                if through_lane:
                    np.copyto(piece, own)
                right.send(key, 0, 0, offset, piece if through_lane else own)
            faults.COLLECTIVE_UNDER_WAY(step, lambda: right.flush(waiting_on(right.peer, lambda: right.last_progress)))
            # (phase, round, chunk received); each received piece goes on to the right in the next
            # round, the reduce-scatter's last into the all-gather's first; the all-gather's last stays.
            rounds = [(0, r, (rank - r - 1) % n) for r in range(n - 1)] + [(1, r, (rank - r) % n) for r in range(n - 1)]
            for (phase, rnd, i), following in zip(rounds, rounds[1:] + [None]):
                for (offset, piece), (_, own) in zip(pieces(out, i), pieces(mine, i)):
                    self._take(from_left, key, phase, rnd, offset, piece, own, receiving)
                    self._adopt(from_left, right, version)
                    if following is not None:
                        right.send(key, following[0], following[1], offset, piece)
            right.finish(waiting_on(right.peer, lambda: right.last_progress))
        except BaseException:
            right.cancel()
            raise
        self._succeeded = key
        out = out.view()
        out.flags.writeable = False  # through a lane, it is also what the right neighbour read
        return out

    def _shared_buffer(
        self, key: tuple[int, int], rank: int, right: OutLink, size: int
    ) -> tuple[np.ndarray, int] | None:
        """Where this step's result goes in the ring's shared result (view, origin), or None: in the lane.
        The ring's first member makes the segment at a version's first step, if its right link is a lane."""
        version = key[0]
        if self._shared is not None and self._shared.version != version:
            self._shared.close()
            self._shared = None
        if self._shared is None and rank == 0 and right.lane is not None and self._succeeded[0] != version:
            self._shared = SharedResult.create(version, size)
            if self._shared is not None:
                self._shared.name_to(right)
        return None if self._shared is None else self._shared.buffer(key, self._succeeded, right, size)

    def _adopt(self, link: InLink, right: OutLink, version: int) -> None:
        """The ring's shared result, as the left neighbour named it in this version: mapped, and named on
        to the right neighbour if that link is a lane; or, back at the member that made it, unlinked."""
        named = link.result
        if named is None or link.result_version != version or (self._shared and self._shared.segment is named):
            return
        if self._shared is not None and self._shared.name == named.name:  # made here: round the ring
            named.close()
            link.result = self._shared.segment
            self._shared.unlink()
            return
        if self._shared is not None:
            self._shared.close()
        self._shared = SharedResult(named, version, named.nbytes // 8, created=False)
        if right.lane is not None:
            self._shared.name_to(right)

    def _take(
        self,
        link: InLink,
        key: tuple[int, int],
        phase: int,
        rnd: int,
        offset: int,
        piece: np.ndarray,
        own: np.ndarray,
        wait: Callable[[], None],
    ) -> None:
        """The left neighbour's frame for this piece of `out`: added to this member's `own` values into it
        (reduce-scatter), or read into it as it is (all-gather)."""
        while True:
            version, step, *where = link.next_header(wait)
            if (version, step) < key:
                link.skip(wait)  # an aborted attempt's, still in the connection
                continue
            if (version, step) > key:
                raise Aborted(f"{link.peer} has moved on to version {version}, step {step}")
            if where != [phase, rnd, offset, piece.size]:
                raise PeerFailed(
                    link.peer,
                    f"sent (phase, round, offset, count) {tuple(where)} where "
                    f"{(phase, rnd, offset, piece.size)} was expected: do the members "
                    "have the same model?",
                )
            break
        if phase == 0:
            link.add(own, piece, wait)
        else:
            link.payload(piece, wait)

    def _await_new_version(self, key: tuple[int, int], abort_check: Callable[[], None]) -> None:
        # An interrupted attempt is never resumed: frames of it may still be in flight, and could not be
        # told from the retry's. The membership moves on after any interruption (an abort, or a reported
        # peer failure), and abort_check raises Aborted once it has.
        deadline = time.monotonic() + PEER_TIMEOUT_S
        while time.monotonic() < deadline:
            abort_check()
            time.sleep(POLL_S)
        raise Aborted(f"version {key[0]} step {key[1]} was interrupted and the membership has not moved on")

    def close(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.close()
        for link in self._links.values():
            link.close()
        self.listener.close()
