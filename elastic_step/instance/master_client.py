"""The master's client, as workers and PS shards call it: register, leases and progress, holds for a
checkpoint cut, heartbeats, failures. The service it calls is master/service.py; the client lives with the
instances, below the roles that call it, and knows the master only by its wire contract (elastic.proto)."""

from __future__ import annotations

import logging
import time
import traceback

from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import elastic_pb2_grpc as pb_grpc
from elastic_step.proto import rpc


class MasterClient:
    def __init__(self, address: str, token: str, role: str, index: int, launch: int = 0):
        self.token = token
        self.me = pb.Instance(role=role, index=index, launch=launch)
        self._channel = rpc.channel(address)
        self.stub = pb_grpc.MasterStub(self._channel)

    def register(self, address: str = "") -> pb.RegisterResponse:
        """Registers, coming back as often as a master at its limit asks (a burst of workers joining at once)."""
        request = pb.RegisterRequest(token=self.token, instance=self.me, address=address)
        while True:
            reply = rpc.call(self.stub.Register, request)
            if not reply.retry_after_s:
                return reply
            time.sleep(reply.retry_after_s)

    def get_task(self, ahead_of: int | None = None) -> pb.GetTaskResponse:
        return rpc.call(self.stub.GetTask, pb.GetTaskRequest(token=self.token, instance=self.me, ahead_of=ahead_of))

    def report(self, task_id: int, watermark: int, records: int, loss: float, duplicate: bool) -> pb.ProgressResponse:
        """`stop`: the master refused the report (the lease is no longer ours); `hold`: a checkpoint is cut."""
        return rpc.call(
            self.stub.ReportProgress,
            pb.ProgressReport(
                token=self.token,
                instance=self.me,
                task_id=task_id,
                watermark=watermark,
                records=records,
                loss=loss,
                duplicate=duplicate,
            ),
        )

    def hold(self, stop) -> None:
        """Wait while the master cuts a checkpoint (this worker has nothing in flight), or until `stop`."""
        while not stop.is_set():
            if rpc.call(
                self.stub.Hold, pb.HoldRequest(token=self.token, instance=self.me, wait_s=1.0), timeout=10
            ).released:
                return

    def heartbeat(self) -> bool:
        """True when the master asks this instance to stop."""
        return rpc.call(
            self.stub.Heartbeat, pb.HeartbeatRequest(token=self.token, instance=self.me), timeout=10, retry_for=10
        ).stop

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
        self._channel.close()
