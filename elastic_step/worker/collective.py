"""Ring AllReduce between workers over gRPC, and the worker's Collective service.

N members, one flat float32 buffer split into N chunks: N-1 reduce-scatter rounds, then N-1
all-gather rounds. In each round a member sends one chunk to its right neighbour
(`Collective.SendChunk`, a unary RPC) and waits for its left neighbour's chunk in a mailbox keyed
(version, step, phase, round, sub). A chunk travels as sub-chunks of ~1 MB sent back to back,
several in flight, so bandwidth rather than per-message overhead bounds a large buffer.

Every member ends with bitwise the same sum: each chunk is reduced once, by one member, then
copied around the ring. A wait polls for an abort every ~50 ms (`abort_check`: the master's
membership version changed); a send the peer does not answer raises `PeerFailed`. Either way the
caller discards the partial result: nothing of an aborted step is applied.

The same server answers `PullState`: a newcomer asks a live peer for every model weight and
optimizer variable once that peer has applied a given step.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import threading
import time
from typing import Callable

import grpc
import numpy as np

from elastic_step.instance import kill_self
from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import elastic_pb2_grpc as pb_grpc
from elastic_step.proto import rpc, tensors
from elastic_step.proto.rpc import check_token

log = logging.getLogger("elastic_step.worker")

SUB_CHUNK_BYTES = 1 << 20
POLL_S = 0.05
SEND_TIMEOUT_S = 10.0
CHAOS_ENV = "ELASTIC_STEP_COLLECTIVE_CHAOS"   # tests: "worker-1@step=25" SIGKILLs worker-1 mid-collective


class Aborted(Exception):
    """The step's membership changed while it ran: discard the partial result and retry."""


class PeerFailed(Exception):
    def __init__(self, peer: str, detail: str):
        super().__init__(f"{peer}: {detail}")
        self.peer, self.detail = peer, detail


class Mailbox:
    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.items: dict[tuple, bytes] = {}

    def put(self, key: tuple, data: bytes) -> None:
        with self.cv:
            self.items[key] = data
            self.cv.notify_all()

    def take(self, key: tuple, abort_check: Callable[[], None], timeout_s: float = 120.0) -> bytes:
        deadline = time.monotonic() + timeout_s
        while True:
            with self.cv:
                if self.cv.wait_for(lambda: key in self.items, POLL_S):
                    return self.items.pop(key)
            abort_check()       # outside the lock: it may call the master
            if time.monotonic() > deadline:
                raise Aborted(f"no chunk {key} from the left neighbour in {timeout_s:.0f} s")

    def purge(self, version: int, step: int) -> None:
        """Drop chunks of attempts older than (version, step)."""
        with self.cv:
            for k in [k for k in self.items if (k[0], k[1]) < (version, step)]:
                del self.items[k]


class StateProvider:
    """What PullState serves: the worker's applied step and a snapshot of its variables."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.applied_step = -1
        # () -> (number of model weights, weights then optimizer variables, the records they hold)
        self.snapshot: Callable[[], tuple[int, list[np.ndarray], dict]] | None = None

    def set_applied(self, step: int) -> None:
        with self.cv:
            self.applied_step = step
            self.cv.notify_all()


class CollectiveService(pb_grpc.CollectiveServicer):
    def __init__(self, token: str, mailbox: Mailbox, state: StateProvider):
        self.token, self.mailbox, self.state = token, mailbox, state

    def SendChunk(self, request, context):
        check_token(context, self.token, request.token)
        self.mailbox.put((request.version, request.step, request.phase, request.round, request.sub),
                         request.data)
        return pb.Ack()

    def PullState(self, request, context):
        check_token(context, self.token, request.token)
        st = self.state
        with st.cv:
            if request.step >= 0:
                st.cv.wait_for(lambda: st.applied_step >= request.step or not context.is_active(), 30.0)
                if st.applied_step != request.step:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"peer is at step {st.applied_step}, asked for {request.step}")
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


def pull_state(address: str, token: str, step: int, timeout: float = 60.0) -> tensors.MemberState:
    ch = rpc.channel(address)
    try:
        return tensors.decode_state(pb_grpc.CollectiveStub(ch).PullState(pb.StateRequest(token=token, step=step),
                                                                          timeout=timeout))
    finally:
        ch.close()


def chaos_target(me: str) -> int | None:
    """The step at which this worker SIGKILLs itself mid-collective (tests), or None."""
    for spec in filter(None, os.environ.get(CHAOS_ENV, "").split(",")):
        name, _, at = spec.partition("@step=")
        if name == me and at.isdigit():
            return int(at)
    return None


class Ring:
    """This member's side of the ring: channels to peers, a pool of in-flight sends."""

    def __init__(self, token: str, mailbox: Mailbox, me: str, sends_in_flight: int = 4):
        self.token = token
        self.mailbox = mailbox
        self.me = me
        self._channels: dict[str, tuple[grpc.Channel, pb_grpc.CollectiveStub]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=sends_in_flight,
                                                           thread_name_prefix="ring-send")
        self.chaos_step = chaos_target(me)

    def _stub(self, address: str) -> pb_grpc.CollectiveStub:
        if address not in self._channels:
            ch = rpc.channel(address)
            self._channels[address] = (ch, pb_grpc.CollectiveStub(ch))
        return self._channels[address][1]

    def allreduce(self, buf: np.ndarray, members: list[tuple[str, str]], version: int, step: int,
                  abort_check: Callable[[], None]) -> np.ndarray:
        """The element-wise SUM of every member's `buf` (float32, same size everywhere)."""
        n = len(members)
        out = np.array(buf, dtype=np.float32, copy=True)
        if n == 1:
            return out
        self.mailbox.purge(version, step)
        rank = [name for name, _ in members].index(self.me)
        right_name, right_addr = members[(rank + 1) % n]
        stub = self._stub(right_addr)
        bounds = np.linspace(0, out.size, n + 1).astype(np.int64)
        chunk = [out[bounds[i]:bounds[i + 1]] for i in range(n)]       # views into `out`
        per_sub = max(1, SUB_CHUNK_BYTES // 4)

        def subs(a: np.ndarray) -> list[np.ndarray]:
            return [a[i:i + per_sub] for i in range(0, max(a.size, 1), per_sub)]

        def send(phase: int, rnd: int, a: np.ndarray) -> list:
            return [self._pool.submit(stub.SendChunk, pb.ChunkRequest(
                token=self.token, version=version, step=step, phase=phase, round=rnd, sub=i,
                data=part.tobytes()), timeout=SEND_TIMEOUT_S) for i, part in enumerate(subs(a))]

        def settle(futures: list) -> None:
            for f in futures:
                try:
                    f.result()
                except grpc.RpcError as e:
                    raise PeerFailed(right_name, f"{e.code().name}: {e.details()}") from e

        def receive(phase: int, rnd: int, into: np.ndarray, add: bool) -> None:
            for i, part in enumerate(subs(into)):
                data = np.frombuffer(self.mailbox.take((version, step, phase, rnd, i), abort_check),
                                     dtype="<f4")
                if data.size != part.size:
                    raise Aborted(f"chunk of {data.size} values, expected {part.size}")
                if add:
                    part += data
                else:
                    part[:] = data

        pending: list = []
        for phase in (0, 1):
            for rnd in range(n - 1):
                if phase == 0:
                    send_i, recv_i = (rank - rnd) % n, (rank - rnd - 1) % n
                else:
                    send_i, recv_i = (rank + 1 - rnd) % n, (rank - rnd) % n
                settle(pending)
                pending = send(phase, rnd, chunk[send_i])
                if self.chaos_step == step and phase == 0 and rnd == 0:
                    settle(pending)
                    log.warning("chaos: SIGKILL myself in the middle of step %d's collective", step)
                    kill_self(signal.SIGKILL)
                receive(phase, rnd, chunk[recv_i], add=phase == 0)
        settle(pending)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for ch, _ in self._channels.values():
            ch.close()
