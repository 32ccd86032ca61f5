"""The ring AllReduce's data path: TCP between ring neighbours, payloads through shared memory on one host.

Each worker listens on a port of its own for ring data (`RingListener`, beside its Collective gRPC
server, which tells peers the port: `Collective.RingEndpoint`). A member writes to its right
neighbour over one connection (`OutLink`: over TCP, with a sender thread) and reads its left
neighbour's connection itself (`InLink`), so sending, receiving and reducing overlap.

A connection opens with a hello: magic, the job token, the sender's name, gRPC address and launch (a peer
relaunched under the same name is another peer), and the name of a shared-memory lane (ring_lane.py)
or nothing. The listener answers ACCEPTED and whether it mapped the lane, or REFUSED with a reason and
closes: a connection without the job's token carries no data, and neither does one of a launch older than
one of the same name that connected since (a zombie: the master fenced it when it gave it up, and its
successor took its place): its connection is refused, and an open one of it closed, its frames unread.
Then frames: a header (version, step, phase, round, offset, count, origin, where), and `count` raw
little-endian float32 values, the step's values from `offset` on, that follow it over TCP, read with
recv_into straight into numpy memory, or that lie at `origin + offset` in the sender's lane or in the
ring's shared result (`where`; `origin`: where the step's buffer begins there). Through a lane, the
sender announces the lane's growth (a LANE_GROWN frame), or that it could not grow it and goes on over
TCP (LANE_DROPPED), and names the ring's shared result (RESULT_SHARED, ring_result.py); nothing comes
back (ring_lane.py says why none is needed).

Frames of one attempt arrive in the order the receiver expects them. A frame of an older
(version, step) is read and dropped, so stale data is never mixed into a newer step; a frame of a
newer one is left unread for the attempt it belongs to, and the attempt in hand is `Aborted` (the
left neighbour has moved on: the membership changed). An attempt interrupted halfway leaves its
connections usable: the rest of a half-read frame is dropped first thing next time, and a frame half
written is finished by the sender thread.

Nothing blocks for long: sockets time out every POLL_S and a wait then runs the caller's check
(`abort_check`, the sender thread's failure). A closed or reset connection is `PeerFailed`, and so is
a neighbour that sends or takes nothing for PEER_TIMEOUT_S.
"""

from __future__ import annotations

import collections
import hmac
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

import numpy as np

from elastic_step.util.shared_memory import SharedMemoryUnavailable
from elastic_step.worker.allreduce.ring_lane import Lane

log = logging.getLogger("elastic_step.worker")

POLL_S = 0.05
PEER_TIMEOUT_S = 120.0
HELLO_TIMEOUT_S = 10.0
MAGIC = b"ESR6"  # 6: the hello names the sender's launch
HELLO = struct.Struct("<4sHHHH")  # magic; lengths of the token, the sender's name and address, the lane's name
LAUNCH = struct.Struct("<q")  # the sender's launch, after the hello's strings
FRAME = struct.Struct("<qqiiqqqi")  # version, step, phase, round, offset, count (float32 values), origin, where
LANE_GROWN = -1  # a frame's phase: the lane is now `offset` bytes long
LANE_DROPPED = -2  # a frame's phase: payloads follow over TCP from now on
RESULT_SHARED = -3  # a frame's phase: the ring's shared result, `offset` values a buffer;
# its name, `count` bytes, follows over TCP
IN_LANE, IN_RESULT = 0, 1  # where: a piece through a lane lies in it, or in the shared result
ACCEPTED, REFUSED = b"\x01", b"\x00"
DROP_BYTES = 1 << 20  # read size when dropping a stale frame
WRITE_FRAMES = 64  # most frames in one write (well under IOV_MAX)


class Aborted(Exception):
    """The step's membership changed while it ran: discard the partial result and retry."""


class PeerFailed(Exception):
    def __init__(self, peer: str, detail: str):
        super().__init__(f"{peer}: {detail}")
        self.peer, self.detail = peer, detail


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("closed during the hello")
        data += part
    return bytes(data)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a frame's header must not wait
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # an idle link to a vanished host errs


def _stream(sock: socket.socket) -> None:
    """Blocking calls that give up after POLL_S: one system call moves a whole piece (MSG_WAITALL, a
    blocking sendmsg) instead of a poll and a partial read or write each time."""
    sock.settimeout(None)
    poll = struct.pack("ll", 0, int(POLL_S * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, poll)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, poll)


class InLink:
    """A left neighbour's connection (and lane, if any), used only by the allreduce's own thread."""

    def __init__(self, sock: socket.socket, peer: str, lane: Lane | None = None):
        self.sock, self.peer, self.lane = sock, peer, lane
        self._scratch = np.empty(0, np.float32)  # a TCP payload, before it is added
        self.header = bytearray(FRAME.size)
        self.header_got = 0  # bytes of `header` read so far
        self.pending: tuple | None = None  # a header read whose payload is not
        self.origin = 0  # the pending frame's: where its step's buffer begins in the lane
        self.where = IN_LANE  # the pending frame's: the segment it lies in
        self.result: Lane | None = None  # the ring's shared result, as the left neighbour named it
        self.result_version = -1  # the version it was named in
        self.payload_left = 0  # bytes of an abandoned frame's payload still to drop
        self.last_progress = time.monotonic()
        self._drop = bytearray(DROP_BYTES)

    def _recv(self, view: memoryview, wait: Callable[[], None]) -> int:
        while True:
            try:
                n = self.sock.recv_into(view, 0, socket.MSG_WAITALL)
            except (TimeoutError, BlockingIOError):  # nothing for POLL_S
                wait()
                continue
            except OSError as e:
                raise PeerFailed(self.peer, f"ring connection failed: {e}") from e
            if n == 0:
                raise PeerFailed(self.peer, "closed the ring connection")
            self.last_progress = time.monotonic()
            return n

    def next_header(self, wait: Callable[[], None]) -> tuple:
        """(version, step, phase, round, offset, count) of the next frame; `payload`, `add` or `skip` takes
        it. A lane's growth, announced in between, is taken care of here."""
        while self.pending is None:
            self._drain_payload(None, wait)
            view = memoryview(self.header)
            while self.header_got < FRAME.size:
                self.header_got += self._recv(view[self.header_got :], wait)
            self.header_got = 0
            frame = FRAME.unpack(self.header)
            if frame[2] in (LANE_GROWN, LANE_DROPPED):
                self._lane_changed(frame[2], frame[4])
                continue
            if frame[2] == RESULT_SHARED:
                self._result_named(frame[0], frame[4], frame[5], wait)
                continue
            self.pending, self.origin, self.where = frame[:6], frame[6], frame[7]
            self.payload_left = 4 * frame[5] if self.lane is None else 0
        return self.pending

    def payload(self, into: np.ndarray, wait: Callable[[], None]) -> None:
        """The pending frame's values, into `into` (float32, exactly the frame's count)."""
        if self.lane is None:
            self.pending = None
            self._drain_payload(memoryview(into).cast("B"), wait)
            return
        piece = self._in_lane()
        if piece.__array_interface__["data"] != into.__array_interface__["data"]:
            np.copyto(into, piece)  # (in the shared result, the left neighbour's piece is this one's)

    def add(self, own: np.ndarray, into: np.ndarray, wait: Callable[[], None]) -> None:
        """The pending frame's values plus `own`, into `into` (both float32, exactly the frame's count)."""
        if self.lane is None:
            if self._scratch.size < into.size:
                self._scratch = np.empty(into.size, np.float32)
            incoming = self._scratch[: into.size]
            self.payload(incoming, wait)
            np.add(own, incoming, out=into)
        else:
            np.add(own, self._in_lane(), out=into)

    def skip(self, wait: Callable[[], None]) -> None:
        self.pending = None
        if self.lane is None:  # through a lane there is nothing to drop
            self._drain_payload(None, wait)

    def _in_lane(self) -> np.ndarray:
        *_, offset, count = self.pending
        self.pending = None
        segment = self.lane if self.where == IN_LANE else self.result
        if segment is None:
            raise PeerFailed(self.peer, "sent a frame in a shared result that this side has not mapped")
        try:
            return segment.piece(self.origin + offset, count)
        except ValueError as e:
            raise PeerFailed(self.peer, f"sent a frame whose {e}") from e

    def _lane_changed(self, change: int, nbytes: int) -> None:
        if self.lane is None:
            raise PeerFailed(self.peer, "changed a shared-memory lane that this connection does not have")
        if change == LANE_DROPPED:
            self.lane.close()
            self.lane = None
            return
        try:
            self.lane.grown(nbytes)
        except (OSError, ValueError) as e:
            raise PeerFailed(self.peer, f"announced a lane of {nbytes} bytes: {e}") from e

    def _result_named(self, version: int, values: int, name_bytes: int, wait: Callable[[], None]) -> None:
        received = bytearray(name_bytes)
        self.payload_left = name_bytes
        self._drain_payload(memoryview(received), wait)
        if self.lane is None:
            raise PeerFailed(self.peer, "named a shared result over a link without a lane")
        name = received.decode(errors="replace")
        # None if it is gone: named in an attempt since aborted, whose version its creator has let go of.
        segment = Lane.attach(name, keep_name=True)
        if segment is not None and segment.nbytes != 2 * 4 * values:
            segment.close()
            raise PeerFailed(self.peer, f"named a shared result, {name!r}, that is not two buffers of {values} values")
        if self.result is not None:
            self.result.close()  # unmapped once no view of it is left
        self.result, self.result_version = segment, version

    def _drain_payload(self, into: memoryview | None, wait: Callable[[], None]) -> None:
        # If interrupted, `payload_left` keeps what is still unread: the next call drops it.
        while self.payload_left:
            if into is None:
                view = memoryview(self._drop)[: min(self.payload_left, DROP_BYTES)]
            else:
                view = into[len(into) - self.payload_left :]
            self.payload_left -= self._recv(view, wait)

    def close(self) -> None:
        self.sock.close()
        for segment in (self.lane, self.result):
            if segment is not None:
                segment.close()  # unmapped once no view of it is left
        self.lane = self.result = None


class OutLink:
    """The connection to the right neighbour, and its lane if any.

    Through a lane, the step's output is in the lane (`output`): a piece is sent once it is in place
    there, by writing its header. Over TCP, a sender thread writes the frames in the order they are
    queued while the allreduce's thread receives and reduces; the payloads are views of the caller's
    buffers, which must not change before `finish` returns (every frame written to the kernel)."""

    def __init__(self, sock: socket.socket, peer: str, lane: Lane | None = None):
        self.sock, self.peer, self.lane = sock, peer, lane
        self.cv = threading.Condition()
        self.queue: collections.deque = collections.deque()
        self.busy = False  # the thread is writing a frame
        self.failure: str | None = None
        self.closed = False
        self.origin = 0  # where the step's output begins in the lane or shared result
        self.where = IN_LANE  # which of the two it is in
        self.last_progress = time.monotonic()
        if lane is None:
            self._start_sender()

    def _start_sender(self) -> None:
        threading.Thread(target=self._run, name=f"ring-send-{self.peer}", daemon=True).start()

    def output(self, size: int, shared: tuple[np.ndarray, int] | None = None) -> np.ndarray:
        """Where a step's result of `size` values is made: in the ring's `shared` result (view, origin),
        if given (the right neighbour has it); else in the lane, grown if need be, or new memory."""
        self.where = IN_LANE
        if shared is not None and self.lane is not None:
            self.where, (out, self.origin) = IN_RESULT, shared
            return out
        if self.lane is not None:
            try:
                self.origin, grew = self.lane.claim(size)
                if grew:
                    self._send_now(FRAME.pack(0, 0, LANE_GROWN, 0, self.lane.nbytes, 0, 0, 0))
                return self.lane.values[self.origin : self.origin + size]
            except SharedMemoryUnavailable as e:
                # Not the neighbour's fault: this link goes on over TCP (the receiver is told in the stream).
                log.warning("ring link to %s: %s: payloads go over TCP from now on", self.peer, e)
                self._send_now(FRAME.pack(0, 0, LANE_DROPPED, 0, 0, 0, 0, 0))
                self.lane.close()
                self.lane = None
                self._start_sender()
        return np.empty(size, np.float32)

    def send(self, key: tuple[int, int], phase: int, rnd: int, offset: int, values: np.ndarray) -> None:
        """The frame of `values`, the step's values from `offset` on: through a lane, `output`'s own values
        there, already in place; over TCP, a view that stays as it is until `finish` returns."""
        if self.lane is not None:
            self._send_now(FRAME.pack(*key, phase, rnd, offset, values.size, self.origin, self.where))
            return
        frame = FRAME.pack(*key, phase, rnd, offset, values.size, 0, IN_LANE)
        with self.cv:
            self.queue.append((frame, values))
            self.cv.notify_all()

    def name_result(self, version: int, values: int, name: str) -> None:
        """Names the ring's shared result (ring_result.py) to the right neighbour, through a lane's link:
        frames after this one may lie in it."""
        name_b = name.encode()
        self._send_now(FRAME.pack(version, 0, RESULT_SHARED, 0, values, len(name_b), 0, 0), name_b)

    def check(self) -> None:
        if self.failure is not None:
            raise PeerFailed(self.peer, self.failure)

    def finish(self, wait: Callable[[], None]) -> None:
        """The step succeeded: until its buffers are free again. Over TCP, every frame written; through a
        lane, at once (the step's success shows the receiver is done with every earlier one)."""
        if self.lane is not None:
            self.lane.settled()
        else:
            self.flush(wait)

    def flush(self, wait: Callable[[], None]) -> None:
        """Until every frame sent is handed to the kernel (through a lane, each is as it is sent)."""
        if self.lane is not None:
            return
        while True:
            with self.cv:
                if self.queue or self.busy:
                    self.cv.wait(POLL_S)
                done = self.failure is not None or not (self.queue or self.busy)
            self.check()
            if done:
                return
            if time.monotonic() - self.last_progress >= POLL_S:  # stalled: is the step still on?
                wait()

    def cancel(self) -> None:
        """An aborted attempt: drop its frames not yet started (the one being written is finished)."""
        with self.cv:
            self.queue.clear()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.queue.clear()
            self.cv.notify_all()
        lane, self.lane = self.lane, None
        if lane is not None:  # no sender thread to close the connection
            self.sock.close()
            lane.close()  # unmapped once no view of it is left

    def _send_now(self, header: bytes, payload: bytes = b"") -> None:
        """A header (and a short payload) through a lane's connection, from the allreduce's thread."""
        self.check()
        try:
            self._write([memoryview(header + payload)])
        except OSError as e:
            raise self._failed(f"ring connection failed: {e}") from e

    def _failed(self, failure: str) -> PeerFailed:
        """The link is broken for good (`check` says so from now on): the error to raise."""
        self.failure = failure
        return PeerFailed(self.peer, failure)

    def _run(self) -> None:
        while True:
            with self.cv:
                while not (self.queue or self.closed):
                    self.cv.wait()
                if self.closed:
                    break
                # Every frame queued so far in one write: fewer system calls and wake-ups on a busy machine.
                frames = []
                while self.queue and len(frames) < WRITE_FRAMES:
                    frames.append(self.queue.popleft())
                self.busy = True
            try:
                self._write(
                    [v for header, values in frames for v in (memoryview(header), memoryview(values).cast("B"))]
                )
            except OSError as e:
                with self.cv:
                    self.failure = f"ring connection failed: {e}"
                    self.busy = False
                    self.cv.notify_all()
                break
            with self.cv:
                self.busy = False
                self.cv.notify_all()
        self.sock.close()

    def _write(self, views: list[memoryview]) -> None:
        while views:
            if self.closed:
                raise OSError("link closed")
            try:
                n = self.sock.sendmsg(views)
            except (TimeoutError, BlockingIOError):  # the peer took nothing for POLL_S
                if time.monotonic() - self.last_progress > PEER_TIMEOUT_S:
                    raise OSError(f"the peer took nothing for {PEER_TIMEOUT_S:.0f} s") from None
                continue
            self.last_progress = time.monotonic()
            while n and n >= len(views[0]):
                n -= len(views.pop(0))
            if n:
                views[0] = views[0][n:]


def connect(
    peer: str, host: str, port: int, token: str, me: tuple[str, str], shared: bool = True, launch: int = 0
) -> OutLink:
    """A connection to `peer`'s ring listener, admitted with the job token, from `me` (name, gRPC
    address) at its `launch`; with a shared-memory lane if `shared` and the peer can map it. Raises PeerFailed."""
    try:
        sock = socket.create_connection((host, port), timeout=HELLO_TIMEOUT_S)
    except OSError as e:
        raise PeerFailed(peer, f"cannot open a ring connection to {host}:{port}: {e}") from e
    offered = lane = Lane.create() if shared else None
    try:
        _tune(sock)
        token_b, name_b, address_b = token.encode(), me[0].encode(), me[1].encode()
        lane_b = lane.name.encode() if lane is not None else b""
        sock.sendall(
            HELLO.pack(MAGIC, len(token_b), len(name_b), len(address_b), len(lane_b))
            + token_b
            + name_b
            + address_b
            + lane_b
            + LAUNCH.pack(launch)
        )
        answer = _recv_exact(sock, 1)
        if answer != ACCEPTED:
            reason = sock.recv(500).decode(errors="replace")
            raise PeerFailed(peer, f"{host}:{port} refused the ring connection: {reason}")
        if _recv_exact(sock, 1) != ACCEPTED:
            lane = None  # the peer cannot see it: payloads over TCP
    except (OSError, ConnectionError) as e:
        sock.close()
        lane = None
        raise PeerFailed(peer, f"ring connection to {host}:{port} failed during the hello: {e}") from e
    except PeerFailed:
        sock.close()
        lane = None
        raise
    finally:
        if offered is not None:
            offered.unlink()  # open on both sides now, or on this one only until it lets go
            if lane is None:
                offered.close()
    log.info("ring link to %s: payloads %s", peer, "through shared memory" if lane is not None else "over TCP")
    _stream(sock)
    return OutLink(sock, peer, lane)


class RingListener:
    """Accepts left neighbours' connections; keeps the newest one from each peer (name, gRPC address)."""

    def __init__(self, token: str, host: str):
        self.token = token.encode()
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        self.cv = threading.Condition()
        self.links: dict[tuple[str, str], InLink] = {}
        self.replaced: list[InLink] = []
        self.launches: dict[str, int] = {}  # peer name -> the newest launch of it that connected
        self.fenced_refused = 0  # connections of an older launch refused or closed (see the module)
        threading.Thread(target=self._accept, name="ring-listener", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._admit, args=(conn,), name="ring-hello", daemon=True).start()

    def _admit(self, conn: socket.socket) -> None:
        lane = None
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            magic, token_len, name_len, address_len, lane_len = HELLO.unpack(_recv_exact(conn, HELLO.size))
            if magic != MAGIC:
                return self._refuse(conn, "not an elastic-step ring connection")
            token, name, address, lane_name = (
                _recv_exact(conn, token_len),
                _recv_exact(conn, name_len).decode(errors="replace"),
                _recv_exact(conn, address_len).decode(errors="replace"),
                _recv_exact(conn, lane_len).decode(errors="replace"),
            )
            (launch,) = LAUNCH.unpack(_recv_exact(conn, LAUNCH.size))
            if not hmac.compare_digest(token, self.token):
                log.warning("refused a ring connection from %s (%s): wrong job token", name, conn.getpeername())
                return self._refuse(conn, "wrong job token")
            if (refusal := self._fenced(name, address, launch)) is not None:
                return self._refuse(conn, refusal)
            lane = Lane.attach(lane_name) if lane_name else None
            _tune(conn)
            conn.sendall(ACCEPTED + (ACCEPTED if lane is not None else REFUSED))
        except (OSError, ConnectionError, struct.error):
            conn.close()
            if lane is not None:
                lane.close()
            return
        _stream(conn)
        with self.cv:
            old = self.links.get((name, address))
            if old is not None:
                self.replaced.append(old)  # closed by the reader's thread, which may be reading it
            self.links[(name, address)] = InLink(conn, name, lane)
            self.cv.notify_all()

    def _fenced(self, name: str, address: str, launch: int) -> str | None:
        """Why a connection of `name`'s `launch` is refused (a newer launch of it connected before), or None. A newer
        launch closes the older ones' connections. Launch 0 (not told) is never refused."""
        with self.cv:
            newest = self.launches.get(name, 0)
            if launch <= 0 or launch >= newest:
                self.launches[name] = max(newest, launch)
                stale = [key for key in self.links if key[0] == name and key[1] != address] if launch > newest else []
                for key in stale:  # an older launch's: closed by the reader's thread, which may be reading it
                    self.replaced.append(self.links.pop(key))
                    self.fenced_refused += 1
                    log.warning("closed the ring connection of %s at %s: launch %d of it connected since", *key, launch)
                return None
            self.fenced_refused += 1
        log.warning("refused a ring connection of %s launch %d: launch %d of it connected since", name, launch, newest)
        return f"fenced: {name} launch {launch}: launch {newest} of it joined the ring since"

    @staticmethod
    def _refuse(conn: socket.socket, reason: str) -> None:
        try:
            conn.sendall(REFUSED + reason.encode())
        finally:
            conn.close()

    def link_from(self, peer: tuple[str, str], wait: Callable[[], None]) -> InLink:
        """The newest connection from `peer` (name, gRPC address), once it has connected."""
        while True:
            with self.cv:
                for old in self.replaced:
                    old.close()
                self.replaced.clear()
                link = self.links.get(peer)
                if link is None:
                    self.cv.wait(POLL_S)
                    link = self.links.get(peer)
            if link is not None:
                return link
            wait()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread: close alone would not
        except OSError:
            pass
        self.sock.close()
        with self.cv:
            for link in [*self.links.values(), *self.replaced]:
                link.close()
            self.links.clear()
            self.replaced.clear()
