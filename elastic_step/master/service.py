"""The master's gRPC service: a thin translation of RPCs into Coordinator calls.

Every call checks the per-job token, so another pod in the namespace cannot join the job.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from elastic_step.backends.api import InstanceId
from elastic_step.master.coordinator import Coordinator
from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import elastic_pb2_grpc as pb_grpc
from elastic_step.proto import rpc, tensors
from elastic_step.proto.rpc import check_token
from elastic_step.util.phases import phase

WAIT_S = 0.05
STEP_WAIT_S = 0.5  # allreduce long-polls: the worker asks again after this


# Progress reports the master budgets for, per second, over all workers: about 40 % of what one
# master serves (bench/master_capacity.py: ~2 500 reports/s), leaving the rest for GetTask, heartbeats
# and each lease's last report, which goes unpaced.
REPORTS_PER_S_BUDGET = 1000.0
MIN_REPORT_INTERVAL_S = 0.05


def report_interval_s(max_workers: int) -> float:
    """How often each worker may report: 50 ms up to 50 workers, then slower as the job grows, so
    that the master's load from reports stays flat. Coarser reports only mean a lost worker's
    pushed-but-unreported minibatches are re-pushed (and skipped by the PS)."""
    return max(MIN_REPORT_INTERVAL_S, max_workers / REPORTS_PER_S_BUDGET)


class MasterService(pb_grpc.MasterServicer):
    def __init__(
        self,
        coordinator: Coordinator,
        token: str,
        job_id: str,
        minibatch_size: int,
        model_def: str,
        max_workers: int = 1,
        pushes_in_flight: int = 1,
        minibatches_per_push: int = 1,
    ):
        self.c = coordinator
        self.token = token
        self.job_id = job_id
        self.minibatch_size = minibatch_size
        self.model_def = model_def
        self.report_interval_s = report_interval_s(max_workers)
        self.pushes_in_flight = pushes_in_flight
        self.minibatches_per_push = minibatches_per_push
        # allreduce, a resumed job: () -> the MemberState of the checkpoint the members start from, or
        # None (see master/checkpoint.py).
        self.checkpoint_state = lambda: None
        # A URI as instances open it: a file local to the step, served by the master (input_server.py).
        self.locate: Callable[[str], str] = lambda uri: uri

    def _instance(self, context, call: str, msg: pb.Instance) -> InstanceId:
        """The caller, unless its launch is fenced (master/fence.py): then the call is refused, PERMISSION_DENIED."""
        try:
            inst = InstanceId(msg.role, msg.index)
        except Exception as e:  # noqa: BLE001 - any malformed identity is the caller's error
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if (refusal := self.c.fenced_call(inst, msg.launch, call)) is not None:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        return inst

    def Register(self, request, context):
        check_token(context, self.token, request.token)
        addrs = self.c.register(self._instance(context, "Register", request.instance), request.address)
        return pb.RegisterResponse(
            job_id=self.job_id,
            ps_addresses=addrs,
            minibatch_size=self.minibatch_size,
            model_def=self.locate(self.model_def),
            report_interval_s=self.report_interval_s,
            pushes_in_flight=self.pushes_in_flight,
            ps_generation=self.c.ps_generation,
            minibatches_per_push=self.minibatches_per_push,
        )

    def Heartbeat(self, request, context):
        check_token(context, self.token, request.token)
        inst = self._instance(context, "Heartbeat", request.instance)
        with self.c.lock:
            self.c.membership.seen(inst)
        return pb.HeartbeatResponse(stop=self.c.stop_all.is_set())

    def GetTask(self, request, context):
        check_token(context, self.token, request.token)
        lease = self.c.get_task(
            self._instance(context, "GetTask", request.instance),
            after=request.ahead_of if request.HasField("ahead_of") else None,
        )
        if lease == "done":
            return pb.GetTaskResponse(kind=pb.GetTaskResponse.DONE)
        if lease is None:
            return pb.GetTaskResponse(kind=pb.GetTaskResponse.WAIT, retry_after_s=WAIT_S)
        t = lease.task
        return pb.GetTaskResponse(
            kind=pb.GetTaskResponse.TASK,
            task=pb.Task(
                task_id=t.task_id,
                epoch=t.epoch,
                shard=self.locate(t.shard),
                start=lease.watermark,
                end=t.end,
                task_start=t.start,
                shard_index=self.c.ledger.shard_index[t.shard],
            ),
        )

    def ReportProgress(self, request, context):
        check_token(context, self.token, request.token)
        with phase("master: ReportProgress"):
            return self._report_progress(request, context)

    def _report_progress(self, request, context):
        ok = self.c.report_progress(
            self._instance(context, "ReportProgress", request.instance),
            request.task_id,
            request.watermark,
            request.loss,
            request.duplicate,
        )
        return pb.ProgressResponse(stop=not ok, hold=self.c.holding)

    def Hold(self, request, context):
        check_token(context, self.token, request.token)
        return pb.HoldReply(
            released=self.c.hold(self._instance(context, "Hold", request.instance), min(request.wait_s, 5.0))
        )

    def ReportFailure(self, request, context):
        check_token(context, self.token, request.token)
        self.c.report_failure(
            str(self._instance(context, "ReportFailure", request.instance)),
            request.kind,
            request.message,
            request.traceback,
            request.minibatch,
        )
        return pb.Ack()

    def ReportSkipped(self, request, context):
        check_token(context, self.token, request.token)
        r = request
        worker = str(self._instance(context, "ReportSkipped", r.instance))
        self.c.skipped_minibatch(worker, r.epoch, r.data_shard, r.shard, r.start, r.end, r.why, r.step)
        return pb.Ack()

    # ------------------------------------------------------------ --strategy allreduce
    def _rendezvous(self, context):
        if self.c.rendezvous is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this job does not use --strategy allreduce")
        return self.c.rendezvous

    def _view(self, view) -> pb.MembershipReply:
        return pb.MembershipReply(
            state=getattr(pb.MembershipReply, view.state.upper()),
            version=view.version,
            members=[pb.Peer(name=n, address=a) for n, a in view.members],
            rank=view.rank,
            base_step=view.base_step,
            committed_step=view.committed_step,
            max_workers=self.c.rendezvous.max_workers,
            restore_checkpoint=view.restore_checkpoint,
        )

    def GetMembership(self, request, context):
        check_token(context, self.token, request.token)
        rdv = self._rendezvous(context)
        inst = self._instance(context, "GetMembership", request.instance)
        self.c.heard_from(inst)  # a member waiting on a stalled ring is not the one stalling it
        view = rdv.membership(str(inst), request.known_version, min(STEP_WAIT_S, max(0.0, request.wait_s)))
        return self._view(view)

    def StepReady(self, request, context):
        from elastic_step.master.rendezvous import ABORT, COMMIT, Ready

        check_token(context, self.token, request.token)
        rdv = self._rendezvous(context)
        inst = self._instance(context, "StepReady", request.instance)
        self.c.heard_from(inst)
        kind, view = rdv.step_ready(
            str(inst),
            request.version,
            request.step,
            Ready(
                request.task_id,
                request.watermark,
                request.records,
                request.loss,
                request.checksum,
                request.compute_s,
            ),
            wait_s=STEP_WAIT_S,
        )
        k = {COMMIT: pb.StepReadyReply.COMMIT, ABORT: pb.StepReadyReply.ABORT}.get(kind, pb.StepReadyReply.WAIT)
        return pb.StepReadyReply(kind=k, membership=self._view(view), done=rdv.done)

    def PullCheckpointState(self, request, context):
        check_token(context, self.token, request.token)
        self._rendezvous(context)
        state = self.checkpoint_state()
        if state is None or (request.step >= 0 and state.step != request.step):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no checkpoint state of step {request.step} here (the job resumed from "
                f"{'none' if state is None else f'step {state.step}'})",
            )
        return tensors.state_reply(state)

    def ReportPeerFailure(self, request, context):
        check_token(context, self.token, request.token)
        self._rendezvous(context)
        inst = self._instance(context, "ReportPeerFailure", request.instance)
        self.c.allreduce_peer_failed(str(inst), request.version, request.peer, request.detail)
        return pb.Ack()


def serve(service: MasterService, host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.Server, int]:
    server = rpc.server(max_workers=32)
    pb_grpc.add_MasterServicer_to_server(service, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, bound
