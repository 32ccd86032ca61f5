"""The workers' Session stream to the master (instance/master_client.py, master/service.py), for real: a gRPC
server on 127.0.0.1, the workers' MasterClient, and a TCP relay between them to break the stream under a call."""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import threading
import time

import grpc
import pytest

from elastic_step.instance.master_client import MasterClient
from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import rpc
from tests.unit.master.test_service import MINIBATCH, TASK, TOKEN, Master


class Relay:
    """TCP between the client and the master. `hold(direction)` swallows what goes that way ("up": the client's
    calls, "down": the master's replies), as a connection that silently stopped would; `cut()` closes every
    connection, as a reset would."""

    def __init__(self, upstream: int):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._upstream = upstream
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self.connections = 0
        self.holding: str | None = None
        self.swallowed = 0  # bytes
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            master = socket.create_connection(("127.0.0.1", self._upstream))
            with self._lock:
                self.connections += 1
                self._socks += [client, master]
            threading.Thread(target=self._pump, args=(client, master, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(master, client, "down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if self.holding == direction:
                    self.swallowed += len(data)
                else:
                    dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def hold(self, direction: str | None) -> None:
        self.holding, self.swallowed = direction, 0

    def cut(self) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._listener.close()
        self.cut()


def until(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


@pytest.fixture
def master():
    m = Master(rows=(64,), records_per_task=4 * MINIBATCH, epochs=1)
    yield m
    m.close()


@pytest.fixture
def relay(master):
    r = Relay(master.port)
    yield r
    r.close()


def test_the_hot_calls_share_one_stream_and_the_rest_stay_unary(master):
    c = master.client(0)
    c.register()
    lease = c.get_task()
    assert lease.kind == TASK.TASK
    t = lease.task
    assert not c.report(t.task_id, t.start + MINIBATCH, MINIBATCH, 0.5, False).stop
    assert not c.heartbeat()
    assert c.session.opened == 1
    assert master.ledger.records_committed_total() == MINIBATCH
    # The unary twins answer as before, for clients that do not stream.
    again = c.stub.GetTask(pb.GetTaskRequest(token=TOKEN, instance=c.me), timeout=10)
    assert again.task.task_id == t.task_id and again.task.start == t.start + MINIBATCH


@pytest.mark.parametrize(
    "lost",
    [
        "up",  # the report never reached the master
        "down",  # the master applied it, its reply was lost: applied again, idempotently
    ],
)
def test_a_broken_stream_is_reopened_and_the_unanswered_report_answered_once(master, relay, lost):
    c = MasterClient(f"127.0.0.1:{relay.port}", TOKEN, "worker", 0)
    master.clients.append(c)
    c.register()
    t = c.get_task().task
    relay.hold(lost)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(c.report, t.task_id, t.start + MINIBATCH, MINIBATCH, 0.5, False)
        until(lambda: relay.swallowed > 0, "the report in flight")
        if lost == "down":
            until(lambda: master.ledger.records_committed_total() == MINIBATCH, "the report applied")
        assert not reply.done()
        relay.hold(None)
        relay.cut()
        assert not reply.result(timeout=30).stop
    assert relay.connections == 2 and c.session.opened == 2
    assert master.ledger.records_committed_total() == MINIBATCH
    # The stream goes on: the rest of the lease, once.
    assert not c.report(t.task_id, t.end, t.end - t.start - MINIBATCH, 0.5, False).stop
    assert master.ledger.records_committed_total() == t.end - t.start and c.session.opened == 2


def test_a_reply_not_received_within_the_timeout_fails_as_a_unary_call_would(master):
    c = master.client(0)
    c.register()
    request = pb.GetTaskRequest(token=TOKEN, instance=c.me)
    errors = {}
    with master.coord.lock:  # the master's loop waits on it: no call is answered
        for name, method in (("stream", c.session.GetTask), ("unary", c.stub.GetTask)):
            with pytest.raises(grpc.RpcError) as err:
                method(request, timeout=0.3)
            errors[name] = err.value
        # Retried as a unary call is, and given up at the same point.
        for method in (c.session.GetTask, c.stub.GetTask):
            with pytest.raises(grpc.RpcError) as err:
                rpc.call(method, request, timeout=0.2, retry_for=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert errors["stream"].code() == errors["unary"].code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert errors["stream"].details() == errors["unary"].details()
    # A stream that missed a deadline is given up, as gRPC cancels a unary call past it; the next call opens another.
    opened = c.session.opened
    assert c.get_task().kind == TASK.TASK and c.session.opened == opened + 1


def test_a_refused_call_leaves_the_stream_open(master):
    c = master.client(0)
    c.register()
    impostor = master.client(0, token="wrong-token")
    for call in (impostor.get_task, impostor.heartbeat):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.value.details() == rpc.WRONG_TOKEN
    assert impostor.session.opened == 1
    assert c.get_task().kind == TASK.TASK and master.ledger.records_committed_total() == 0
