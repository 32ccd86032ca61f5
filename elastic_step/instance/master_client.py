"""The master's client, as workers and PS shards call it: register, leases and progress, holds for a
checkpoint cut, heartbeats, failures. The service it calls is master/service.py; the client lives with the
instances, below the roles that call it, and knows the master only by its wire contract (elastic.proto)."""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
import traceback

import grpc

from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import elastic_pb2_grpc as pb_grpc
from elastic_step.proto import rpc

CODES = {c.value[0]: c for c in grpc.StatusCode}
DEADLINE_EXCEEDED = "Deadline Exceeded"  # as gRPC words a unary call's


class CallError(grpc.RpcError):
    """A call on the session stream that ended as its unary twin would have: its status code and details, as
    grpc.RpcError gives them (rpc.call retries the same codes, instance.api.fenced reads the same details)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def answer(reply: pb.SessionReply, kind: str):
    """The reply of a session call of `kind` (its field in SessionCall), or its refusal raised."""
    if reply.code:
        raise CallError(CODES.get(reply.code, grpc.StatusCode.UNKNOWN), reply.details)
    return getattr(reply, kind)


class _Answer:
    """One call's reply, awaited by its caller, set by the stream's reader."""

    __slots__ = ("done", "reply", "error")

    def __init__(self):
        self.done = threading.Event()
        self.reply: pb.SessionReply | None = None
        self.error: CallError | None = None


class _Stream:
    """One open Session stream: calls go out through a queue that gRPC's own thread drains, and a reader
    thread hands each reply to the call of its id. Once broken (the master gone or restarted, a connection
    reset, a call given up), every call still unanswered fails UNAVAILABLE: never answered, it is safe to send
    again, and rpc.call does so on a new stream."""

    def __init__(self, stub: pb_grpc.MasterStub):
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting: dict[int, _Answer] = {}
        self.broken = False
        # Its deadline tells the master how long the stream queued before it was served (Register's backpressure).
        self._replies = stub.Session(iter(self._out.get, None), timeout=rpc.SESSION_DEADLINE_S)
        threading.Thread(target=self._read, name="master-stream", daemon=True).start()

    def send(self, call: pb.SessionCall) -> _Answer:
        a = _Answer()
        with self._lock:
            if self.broken:
                a.error = CallError(grpc.StatusCode.UNAVAILABLE, "the stream to the master broke")
                a.done.set()
                return a
            self._waiting[call.id] = a
        self._out.put(call)
        return a

    def cancel(self) -> None:
        self._replies.cancel()

    def _read(self) -> None:
        code, why = grpc.StatusCode.UNAVAILABLE, "the master ended the stream"
        try:
            for reply in self._replies:
                with self._lock:
                    a = self._waiting.pop(reply.id, None)
                if a is not None:
                    a.reply = reply
                    a.done.set()
        except grpc.RpcError as e:
            why = f"the stream to the master broke ({e.code().name}: {e.details()})"
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # a master without Session: unary calls instead
                code = e.code()
        with self._lock:
            self.broken = True
            waiting, self._waiting = self._waiting, {}
        self._out.put(None)  # ends gRPC's thread draining the requests
        for a in waiting.values():
            a.error = CallError(code, why)
            a.done.set()


class Session:
    """An instance's Register and its hot calls (GetTask, ReportProgress, Heartbeat) on one stream to the master,
    which costs the master a fraction of a unary call per message (master/service.py, Session). `session.GetTask`
    and the others take and return what the unary stub's methods do and fail as they fail: a reply not received
    within `timeout` is DEADLINE_EXCEEDED (and the stream is given up, as gRPC cancels a unary call past its
    deadline), a refusal is the unary call's status. The stream opens at the first call and again at the first call
    after it broke. Against a master without Session, the unary calls."""

    METHODS = {"get_task": "GetTask", "report": "ReportProgress", "heartbeat": "Heartbeat", "register": "Register"}

    def __init__(self, stub: pb_grpc.MasterStub):
        self._stub = stub
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._stream: _Stream | None = None
        self._unary = False
        self.opened = 0  # streams opened: one, unless one broke
        for kind, method in self.METHODS.items():
            setattr(self, method, functools.partial(self.call, kind))

    def call(self, kind: str, request, timeout: float):
        if self._unary:
            return getattr(self._stub, self.METHODS[kind])(request, timeout=timeout)
        with self._lock:
            if self._stream is None or self._stream.broken:
                self._stream = _Stream(self._stub)
                self.opened += 1
            stream, call_id = self._stream, next(self._ids)
        a = stream.send(pb.SessionCall(id=call_id, **{kind: request}))
        if not a.done.wait(timeout):
            stream.cancel()
            raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, DEADLINE_EXCEEDED)
        if a.error is not None:
            if a.error.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._unary = True
                return self.call(kind, request, timeout)
            raise a.error
        return answer(a.reply, kind)

    def close(self) -> None:
        with self._lock:
            if self._stream is not None:
                self._stream.cancel()


class MasterClient:
    def __init__(self, address: str, token: str, role: str, index: int, launch: int = 0, device: str = ""):
        """`device`: what this instance trains on (a worker's), told to the master when it registers."""
        self.token = token
        self.me = pb.Instance(role=role, index=index, launch=launch)
        self.device = device
        self._channel = rpc.channel(address)
        self.stub = pb_grpc.MasterStub(self._channel)
        self.session = Session(self.stub)  # Register and the hot calls; the others are unary

    def register(self, address: str = "") -> pb.RegisterResponse:
        """Registers, coming back as often as a master at its limit asks (a burst of workers joining at once)."""
        request = pb.RegisterRequest(token=self.token, instance=self.me, address=address, device=self.device)
        while True:
            reply = rpc.call(self.session.Register, request)
            if not reply.retry_after_s:
                return reply
            time.sleep(reply.retry_after_s)

    def get_task(self, ahead_of: int | None = None) -> pb.GetTaskResponse:
        return rpc.call(self.session.GetTask, pb.GetTaskRequest(token=self.token, instance=self.me, ahead_of=ahead_of))

    def report(
        self,
        task_id: int,
        watermark: int,
        records: int,
        loss: float,
        duplicate: bool,
        step_s: float = 0.0,
        wait_s: float = 0.0,
    ) -> pb.ProgressResponse:
        """`stop`: the master refused the report (the lease is no longer ours); `hold`: a checkpoint is cut.
        `step_s`, `wait_s`: this launch's time so far computing its steps and waiting on the PS shards."""
        return rpc.call(
            self.session.ReportProgress,
            pb.ProgressReport(
                token=self.token,
                instance=self.me,
                task_id=task_id,
                watermark=watermark,
                records=records,
                loss=loss,
                duplicate=duplicate,
                step_s=step_s,
                wait_s=wait_s,
            ),
        )

    def hold(self, stop) -> list[int]:
        """Wait while the master cuts a checkpoint (this worker has nothing in flight), or until `stop`: each
        shard's version at the cut (empty when not known, or stopped)."""
        while not stop.is_set():
            reply = rpc.call(self.stub.Hold, pb.HoldRequest(token=self.token, instance=self.me, wait_s=1.0), timeout=10)
            if reply.released:
                return list(reply.shard_versions)
        return []

    def heartbeat(self, pushes_applied: int = 0, pushes_skipped: int = 0) -> bool:
        """True when the master asks this instance to stop. A PS shard says its pushes so far, applied and skipped."""
        request = pb.HeartbeatRequest(
            token=self.token, instance=self.me, pushes_applied=pushes_applied, pushes_skipped=pushes_skipped
        )
        return rpc.call(self.session.Heartbeat, request, timeout=10, retry_for=10).stop

    def fail(self, kind: str, error: BaseException, minibatch: str = "") -> None:
        """Tell the master why this instance fails (`minibatch`: the records it failed on, when known)."""
        try:
            rpc.call(
                self.stub.ReportFailure,
                pb.FailureReport(
                    token=self.token,
                    instance=self.me,
                    kind=kind,
                    message=str(error),
                    traceback="".join(traceback.format_exception(error)),
                    minibatch=minibatch,
                ),
                timeout=10,
                retry_for=10,
            )
        except Exception:  # the exit code still tells the master
            logging.exception("could not report the failure to the master")

    def report_skipped(self, records, why: str, step: int = -1) -> None:
        """--skip-non-finite: this worker skipped the minibatch `records` (worker/records.py), for `why`."""
        rpc.call(
            self.stub.ReportSkipped,
            pb.SkipReport(
                token=self.token,
                instance=self.me,
                epoch=records.epoch,
                data_shard=records.data_shard,
                shard=records.shard,
                start=records.start,
                end=records.end,
                why=why,
                step=step,
            ),
            timeout=10,
            retry_for=10,
        )

    def close(self) -> None:
        self.session.close()
        self._channel.close()
