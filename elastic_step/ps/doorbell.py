"""The doorbell: how a worker on a shard's host asks for a shared-memory push without a gRPC call.

With push slots in shared memory (push_slots.py) a push's gRPC call carries only its key, yet for
a small model that call is most of the push: Python's gRPC costs a few hundred µs of CPU on each side
and about a millisecond of latency, next to a training step of about one. So the worker keeps one
connection per slot to the shard's doorbell, a Unix socket in the abstract namespace (no file to
leak: it goes when the shard's process does), sends the push's key and reads back (applied,
version), a few µs of system calls each way.

Exactly-once is unchanged: the key travels, and the shard applies a key at most once. A connection
is admitted only with the nonce of the segment it rings for, which only the worker that created the
segment and the shard that mapped it know. An abstract socket lives in one network namespace, the
same one a loopback PS address already implies.
"""

from __future__ import annotations

import logging
import secrets
import socket
import struct
import threading
from collections.abc import Callable

from elastic_step.ps.api import PushKey

log = logging.getLogger("elastic_step.ps")

HELLO = struct.Struct("<qi16s")  # segment, slot, the segment's nonce
# A PushKey (task_id, seq, end, epoch, data_shard, generation, worker, launch, scale_skipped), want_dense, the
# state's base version (-1: the slot holds gradients, no state; see PushRequest.state_base); a push of several
# minibatches follows it with their bounds (int64 each: seq, ..., end; see PushRequest.bounds).
RING = struct.Struct("<qqqiiqiq??q")
NO_STATE = -1
BOUND = struct.Struct("<q")
MAX_MINIBATCHES = 64  # in one push: their applied flags are one bit each of the answer's mask
# status, applied, version, which minibatches of the push were applied (bit i: minibatch i); a UTF-8 reason
# follows unless OK
ANSWER = struct.Struct("<B?qQ")
OK, DROPPED, FAILED = 0, 1, 2
REFUSED = "refused: "  # a FAILED answer's reason starts so when the shard refused the push (Refused)
MAX_REASON = 2000


class Dropped(Exception):
    """The shard no longer holds the segment (it keeps the most recently used): nothing was applied."""


class PushFailed(Exception):
    """The shard could not apply a push; the message is its reason."""


class FencedPush(Exception):
    """The push is of a worker launch the master fenced: refused, and never retried (its reason says "fenced: ")."""


class Refused(Exception):
    """The shard will not apply this push (it is of another generation): the worker's business, not
    a failure of the shard, so the doorbell answers with the reason and logs nothing."""


def _socket_address(address: str) -> str:
    # "@name" is how ss(8) and gRPC's unix-abstract: show an abstract name; the kernel wants a NUL.
    return "\0" + address[1:] if address.startswith("@") else address


class DoorbellServer:
    """The shard's side. `admit(segment, slot, nonce)` says whether a connection may ring for that
    slot; `push(segment, slot, key, want_dense, bounds, state_base)` applies one (of several minibatches when
    `bounds` holds theirs; `state_base` None unless the slot holds a copy's state) and returns (applied,
    version, applied_each), raising Dropped when the segment is gone. One thread per connection: pushes wait for the
    shard's lock anyway, and a slow or silent peer then holds up nobody else."""

    def __init__(
        self,
        admit: Callable[[int, int, bytes], bool],
        push: Callable[[int, int, PushKey, bool, tuple[int, ...], int | None], tuple[bool, int, list[bool]]],
    ):
        self._admit = admit
        self._push = push
        self.address = f"@elastic-step-doorbell-{secrets.token_hex(8)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(_socket_address(self.address))
        self._listener.listen(64)
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="doorbell", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="doorbell-slot", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(5.0)  # for the hello only: a silent peer does not keep a thread forever
            hello = conn.recv(HELLO.size + 1)
            if len(hello) != HELLO.size or not self._admit(*HELLO.unpack(hello)):
                conn.send(ANSWER.pack(FAILED, False, 0, 0) + b"not admitted: unknown segment, slot or nonce")
                return
            segment, slot, _ = HELLO.unpack(hello)
            conn.settimeout(None)
            conn.send(ANSWER.pack(OK, False, 0, 0))
            while True:
                ring = conn.recv(RING.size + (MAX_MINIBATCHES + 1) * BOUND.size + 1)
                extra = len(ring) - RING.size
                if extra < 0 or extra % BOUND.size or extra > (MAX_MINIBATCHES + 1) * BOUND.size:
                    return  # closed (the worker is gone) or not our protocol
                *key, want_dense, base = RING.unpack_from(ring)
                bounds = tuple(b for (b,) in BOUND.iter_unpack(ring[RING.size :]))
                try:
                    applied, version, each = self._push(
                        segment, slot, PushKey(*key), want_dense, bounds, None if base == NO_STATE else base
                    )
                except Dropped:
                    conn.send(ANSWER.pack(DROPPED, False, 0, 0))
                    return
                except Refused as e:
                    conn.send(ANSWER.pack(FAILED, False, 0, 0) + f"{REFUSED}{e}".encode()[:MAX_REASON])
                    continue
                except FencedPush as e:
                    conn.send(ANSWER.pack(FAILED, False, 0, 0) + str(e).encode()[:MAX_REASON])
                    continue
                except Exception as e:  # the worker gets the reason, as from gRPC
                    log.exception("push through the doorbell failed")
                    conn.send(ANSWER.pack(FAILED, False, 0, 0) + f"{type(e).__name__}: {e}".encode()[:MAX_REASON])
                    continue
                conn.send(ANSWER.pack(OK, applied, version, sum(1 << i for i, a in enumerate(each) if a)))
        except OSError:
            pass  # the peer went away mid-answer, or close() shut us down
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        self._listener.close()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes its thread out of recv
            except OSError:
                pass


class Bell:
    """The worker's side: one connection, for one slot of one segment."""

    def __init__(self, address: str, segment: int, slot: int, nonce: bytes, timeout: float):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(_socket_address(address))
            self._sock.send(HELLO.pack(segment, slot, nonce))
            self._answer()
        except BaseException:
            self._sock.close()
            raise

    def ring(
        self, key: PushKey, want_dense: bool, bounds: tuple[int, ...] = (), state_base: int | None = None
    ) -> tuple[bool, int, list[bool]]:
        """(applied, the shard's version after it, whether each minibatch was applied: one for a push of one);
        the values are in the slot. `bounds`: a push of several minibatches, theirs (PushRequest.bounds);
        `state_base`: the slot holds a copy's state after them instead of their gradients, computed from that
        version (PushRequest.state_base)."""
        base = NO_STATE if state_base is None else state_base
        self._sock.send(RING.pack(*key, want_dense, base) + b"".join(BOUND.pack(b) for b in bounds))
        applied, version, mask = self._answer()
        return applied, version, [bool(mask >> i & 1) for i in range(max(1, len(bounds) - 1))]

    def _answer(self) -> tuple[bool, int, int]:
        data = self._sock.recv(ANSWER.size + MAX_REASON)
        if len(data) < ANSWER.size:
            raise ConnectionError("the PS shard closed its doorbell (it stopped or restarted)")
        status, applied, version, mask = ANSWER.unpack_from(data)
        if status == DROPPED:
            raise Dropped()
        if status != OK:
            raise PushFailed(data[ANSWER.size :].decode(errors="replace"))
        return applied, version, mask

    def close(self) -> None:
        self._sock.close()
