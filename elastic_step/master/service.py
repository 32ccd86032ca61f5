"""The master's gRPC service: a thin translation of RPCs into Coordinator calls.

Every call checks the per-job token, so another pod in the namespace cannot join the job.

The server is grpc.aio on one event loop thread: thousands of workers' calls queue there, not in a pool of
threads that fight over the GIL, and the Coordinator's calls are short and never wait on I/O, so they run on the
loop itself. The calls that wait (a checkpoint hold, allreduce's long polls) run on a thread pool of their own.

An instance's Register and its hot calls (GetTask, ReportProgress, Heartbeat) come on one stream it keeps open
(Session): a message on an open stream costs the master about a quarter of what grpc-python spends on a unary call,
and the master's own work per call is a small part of either. Each is answered as its unary twin, which stays for
other clients.

When calls queue past a target, the master meters the load that is new: a joining worker is given a turn, and its
Register is answered then (or, for a turn far off, answered "come back then", retry_after_s), so that a burst of
workers joining is spread over time instead of queueing every call behind it (Admission). How long calls queue, it
reads from the deadlines of unary calls and of new streams. The calls of workers already in are never shed: each
has at most a call or two in flight, so their queue is bounded.
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc

from elastic_step.backends.api import InstanceId
from elastic_step.master.failures import FailureReports
from elastic_step.master.leases.coordinator import Coordinator
from elastic_step.master.skipped import SkippedMinibatches
from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import elastic_pb2_grpc as pb_grpc
from elastic_step.proto import rpc, tensors
from elastic_step.proto.tensors import MemberState
from elastic_step.util.phases import phase

WAIT_S = 0.05
STEP_WAIT_S = 0.5  # allreduce long-polls: the worker asks again after this


# Progress reports the master budgets for, per second, over all workers: a fifth of what one master
# serves on a core (bench/master_capacity.py: ~5,000 calls/s), leaving the rest for GetTask, heartbeats,
# joining workers and each lease's last report, which goes unpaced.
REPORTS_PER_S_BUDGET = 1000.0
MIN_REPORT_INTERVAL_S = 0.05
# Asks for work that find none, per second, over all workers: the pace of a worker told to wait.
WAITS_PER_S_BUDGET = 2000.0


# The master sheds load once calls wait this long, on average, before it serves them.
QUEUE_TARGET_S = 0.1
# Past that target, joining workers are given turns to come back, this many a second: a join (Register, the
# worker's stream opened, its first GetTask) costs the master about 0.5 ms, so joins take at most half a core
# while the workers already in are served. The turns fall on a grid, so that the workers of one turn arrive
# together and are served in a few wake-ups of the master instead of one each: about a quarter less of its CPU a
# call than turns spread evenly (docs/benchmarks.md, "Joining in turns").
JOINS_PER_S = 1000.0
TURN_GRID_S = 0.1
# A turn this close is waited for on the master, the worker's Register held open until then (a sleeping coroutine
# costs nothing), so that the worker need not call again; a later one is answered "come back then". Well inside
# rpc.CALL_TIMEOUT_S, the caller's deadline.
HOLD_FOR_TURN_S = 10.0
# gRPC's server cancels the calls it has received but not handed to the service yet past 1,000 of them (3,000 at
# most): thousands of workers calling at once would see CANCELLED. Each worker has a call or two in flight.
PENDING_CALLS = [("grpc.server.max_pending_requests", 50_000), ("grpc.server.max_pending_requests_hard_limit", 100_000)]
# Python collects its oldest generation after this many collections of the middle one (its default: 10). Such a
# collection walks every object alive, thousands of streams' among them: at 10,000 workers it stopped the event
# loop for 0.2 to 0.4 s several times a minute, most of the master's GetTask p99. Cyclic garbage that old is rare.
FULL_GC_EVERY = 1000
# The master's serving threads (its event loop, gRPC's) run as batch work (Linux's SCHED_BATCH): a thread woken
# does not preempt the one running. A worker's message wakes gRPC's event engine, then its completion-queue poller,
# then the event loop, each preempting the last on a busy machine, a switch at every step; as batch threads they run
# when the running one blocks or its time slice ends, and the messages that came meanwhile are served in one go.
# 10,000 paced workers: a quarter less of the master's CPU a call, with the same latencies (docs/benchmarks.md,
# "Master capacity").
BATCH_SCHEDULING = True
# Calls that may wait at once (holds, allreduce long polls): one thread each.
WAITING_CALLS = 64
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
NO_CALL = "a session call names no call"

# gRPC sends a timeout as at most three digits of a unit, rounded up: a Session stream's day in hundreds of
# seconds. The day is a whole number of them, so it arrives as 86,400 s, or as 86,500 s when the client's clock
# read a hair late (about every other stream here): modulo the unit, what is left of it is the time it queued.
SESSION_TIMEOUT_UNIT_S = 100.0


class Admission:
    """Backpressure from how long calls wait to be served. Every client of the master sends its unary calls with
    rpc.CALL_TIMEOUT_S and opens its Session stream with rpc.SESSION_DEADLINE_S, and the server's clock for a
    deadline starts when the call arrives, so what is left of it when the call is served tells how long it
    queued. Past `target_s` (smoothed over recent calls), a joining worker is told when to come back: a turn of its
    own, `joins_per_s` turns a second on a grid of TURN_GRID_S, so that a burst of thousands joining at once
    returns as a steady stream the master serves beside the workers already in, instead of a second burst. A worker
    that comes back at its turn joins whatever the wait, so each is told to wait once. A shed call costs no lock
    and no ledger work; under the target every call is served, and calls without those deadlines never move the
    estimate."""

    def __init__(self, target_s: float = QUEUE_TARGET_S, joins_per_s: float = JOINS_PER_S):
        self.target_s = target_s
        self.turn_s = 1.0 / joins_per_s
        self.wait = 0.0  # smoothed, seconds
        self.shed = 0  # calls told to come back, since the master started
        self._turns: dict[object, float] = {}  # a worker told to come back -> its turn (monotonic)
        self._last_turn = 0.0

    def observe(self, context, deadline_s: float = rpc.CALL_TIMEOUT_S) -> None:
        """Every unary call and every new Session stream: how long it queued, from what is left of the deadline
        it was sent with, `deadline_s`."""
        left = context.time_remaining()
        if left is None:
            return
        queued = deadline_s - left
        if deadline_s == rpc.SESSION_DEADLINE_S:
            queued %= SESSION_TIMEOUT_UNIT_S
        # A call sent with another deadline says nothing of the queue (nor does a wait past any call's deadline).
        if 0.0 <= queued < rpc.CALL_TIMEOUT_S:
            self.wait += 0.02 * (queued - self.wait)

    def retry_after(self, who, now: float | None = None) -> float:
        """0 when `who` joins now, else seconds until its turn, which stays its own until it `joined`."""
        now = time.monotonic() if now is None else now
        turn = self._turns.pop(who, None)
        if self.wait <= self.target_s or (turn is not None and now >= turn - self.turn_s):
            return 0.0
        self.shed += 1
        # The turns start past the calls queued now, so that the first to return do not meet the burst's tail.
        self._last_turn = max(now + self.wait, self._last_turn) + self.turn_s
        turn = self._turns[who] = math.ceil(self._last_turn / TURN_GRID_S) * TURN_GRID_S
        return turn - now

    def joined(self, who) -> None:
        """`who` waited for its turn on the master and joins: the turn is used."""
        self._turns.pop(who, None)


def report_interval_s(max_workers: int) -> float:
    """How often each worker may report: 50 ms up to 50 workers, then slower as the job grows, so
    that the master's load from reports stays flat. Coarser reports only mean a lost worker's
    pushed-but-unreported minibatches are re-pushed (and skipped by the PS)."""
    return max(MIN_REPORT_INTERVAL_S, max_workers / REPORTS_PER_S_BUDGET)


class Unobserved:
    """What a service that nobody scrapes observes: nothing (master/observe/metrics.py ServedCalls observes)."""

    def served(self, call: str, seconds: float) -> None:
        pass

    def refused(self, call: str, code: str) -> None:
        pass

    def lease_waited(self, seconds: float) -> None:
        pass


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
        queue_target_s: float = QUEUE_TARGET_S,
        *,
        failures: FailureReports,
        skipped: SkippedMinibatches,
        checkpoint_state: Callable[[], MemberState | None] = lambda: None,
        locate: Callable[[str], str] = lambda uri: uri,
        observed=None,
    ):
        """`failures`, `skipped`: the job's, where the instances' reports go. `checkpoint_state`: allreduce, a
        resumed job: the state the members start from, or None (see master/durability/checkpoint.py). `locate`: a
        URI as instances open it (a file local to the step is served by the master: input_server.py). `observed`:
        told of every hot call served and refused, and of every lease given with how long its worker asked
        (master/observe/metrics.py ServedCalls)."""
        self.c = coordinator
        self.failures, self.skipped = failures, skipped
        self.observed = observed or Unobserved()
        self._asking_since: dict[InstanceId, float] = {}  # workers told to wait for work: since when
        self.admission = Admission(queue_target_s)
        self.calls = 0  # served, of every kind (the event loop is the only writer)
        self._waiting = futures.ThreadPoolExecutor(max_workers=WAITING_CALLS, thread_name_prefix="master-wait")
        self.token = token
        self.job_id = job_id
        self.minibatch_size = minibatch_size
        self.model_def = model_def
        self.report_interval_s = report_interval_s(max_workers)
        self.wait_retry_s = max(WAIT_S, max_workers / WAITS_PER_S_BUDGET)
        self.pushes_in_flight = pushes_in_flight
        self.minibatches_per_push = minibatches_per_push
        self.checkpoint_state, self.locate = checkpoint_state, locate
        # Session: a call's field in SessionCall -> its unary name (as fencing logs it) and its handler.
        self._streamed = {
            "get_task": ("GetTask", self._get_task),
            "report": ("ReportProgress", self._report),
            "heartbeat": ("Heartbeat", self._heartbeat),
            "register": ("Register", self._register),  # a coroutine: a joining worker may wait for its turn
        }

    def _wait_retry_s(self) -> float:
        """When a worker with nothing to do asks again: 50 ms, and slower as the job grows, so that a queue run dry
        under thousands of workers (the end of an epoch) costs the master a flat load. Jittered: they asked
        together, they come back apart."""
        return random.uniform(0.5, 1.5) * self.wait_retry_s

    def _caller(self, call: str, request) -> InstanceId | tuple[grpc.StatusCode, str]:
        """The caller, once its token is checked, unless its launch is fenced (master/gray/fence.py); else the status
        its call is refused with: PERMISSION_DENIED for a fenced launch. Unary calls and the Session stream's
        alike."""
        self.calls += 1
        if not rpc.token_ok(self.token, request.token):
            return grpc.StatusCode.UNAUTHENTICATED, rpc.WRONG_TOKEN
        msg = request.instance
        try:
            inst = InstanceId(msg.role, msg.index)
        except Exception as e:  # noqa: BLE001 - any malformed identity is the caller's error
            return grpc.StatusCode.INVALID_ARGUMENT, str(e)
        if (refusal := self.c.fenced_call(inst, msg.launch, call)) is not None:
            return grpc.StatusCode.PERMISSION_DENIED, refusal
        return inst

    async def _instance(self, context, call: str, request) -> InstanceId:
        """A unary call's caller (see _caller), or the call ends refused."""
        self.admission.observe(context)
        inst = self._caller(call, request)
        if isinstance(inst, tuple):
            self.observed.refused(call, inst[0].name)
            await context.abort(*inst)
        return inst

    async def _timed(self, call: str, context, request, serve):
        """A hot unary call, served and observed."""
        started = time.perf_counter()
        inst = await self._instance(context, call, request)
        reply = serve(inst, request)
        if asyncio.iscoroutine(reply):
            reply = await reply
        self.observed.served(call, time.perf_counter() - started)
        return reply

    async def _wait(self, fn, *args, **kw):
        """Run a call that blocks (a hold, a long poll) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._waiting, lambda: fn(*args, **kw))

    async def Register(self, request, context):
        return await self._timed("Register", context, request, self._register)

    async def Heartbeat(self, request, context):
        return await self._timed("Heartbeat", context, request, self._heartbeat)

    async def GetTask(self, request, context):
        return await self._timed("GetTask", context, request, self._get_task)

    async def ReportProgress(self, request, context):
        return await self._timed("ReportProgress", context, request, self._report)

    async def _register(self, inst: InstanceId, request) -> pb.RegisterResponse:
        member = self.c.membership.members.get(inst)
        joining = inst.role == "worker" and (member is None or member.state != "registered")
        if joining and (wait := self.admission.retry_after(inst)):
            if wait > HOLD_FOR_TURN_S:
                return pb.RegisterResponse(retry_after_s=wait)
            await asyncio.sleep(wait)  # answered at its turn, with the other workers of that turn
            self.admission.joined(inst)
        addrs = self.c.register(inst, request.address, request.device)
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

    def _heartbeat(self, inst: InstanceId, request) -> pb.HeartbeatResponse:
        self.c.heard_from(inst)
        if inst.role == "ps" and (request.pushes_applied or request.pushes_skipped):
            self.c.shard_pushes(inst, request.pushes_applied, request.pushes_skipped)
        return pb.HeartbeatResponse(stop=self.c.stop_all.is_set())

    def _get_task(self, inst: InstanceId, request) -> pb.GetTaskResponse:
        lease = self.c.get_task(inst, after=request.ahead_of if request.HasField("ahead_of") else None)
        if lease == "done":
            self._asking_since.pop(inst, None)
            return pb.GetTaskResponse(kind=pb.GetTaskResponse.DONE)
        if lease is None:
            self._asking_since.setdefault(inst, time.monotonic())
            return pb.GetTaskResponse(kind=pb.GetTaskResponse.WAIT, retry_after_s=self._wait_retry_s())
        asked = self._asking_since.pop(inst, None)
        self.observed.lease_waited(0.0 if asked is None else time.monotonic() - asked)
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

    def _report(self, inst: InstanceId, request) -> pb.ProgressResponse:
        with phase("master: ReportProgress"):
            ok = self.c.report_progress(inst, request.task_id, request.watermark, request.loss, request.duplicate)
            if request.step_s:
                self.c.worker_spent(inst, request.instance.launch, request.step_s, request.wait_s)
        return pb.ProgressResponse(stop=not ok, hold=self.c.holding)

    async def Session(self, calls, context):
        """An instance's stream: its calls answered in the order they come, each as its unary twin answers it (the
        same checks, the same coordinator calls, so fencing and hang detection see no difference). A stream costs
        the master a fraction of a unary call per message, the point of it. Only a joining worker's Register waits
        (for its turn); the other calls run on the loop one after the other. A new stream feeds Admission as a
        unary call does: how long it waited to be served, from its deadline (rpc.SESSION_DEADLINE_S). The calls
        are read and answered on the context (a coroutine, not an async generator over `calls`): fewer layers of
        grpc-python's per message."""
        self.admission.observe(context, rpc.SESSION_DEADLINE_S)
        while (call := await context.read()) is not grpc.aio.EOF:
            kind = call.WhichOneof("call")
            if kind is None:
                await context.write(pb.SessionReply(id=call.id, code=INVALID_ARGUMENT, details=NO_CALL))
                continue
            name, serve = self._streamed[kind]
            request = getattr(call, kind)
            started = time.perf_counter()
            inst = self._caller(name, request)
            if isinstance(inst, tuple):
                self.observed.refused(name, inst[0].name)
                reply = pb.SessionReply(id=call.id, code=inst[0].value[0], details=inst[1])
            elif kind == "register":
                reply = pb.SessionReply(id=call.id, register=await serve(inst, request))
            else:
                reply = pb.SessionReply(id=call.id, **{kind: serve(inst, request)})
            self.observed.served(name, time.perf_counter() - started)
            await context.write(reply)

    async def Hold(self, request, context):
        inst = await self._instance(context, "Hold", request)
        versions = await self._wait(self.c.hold, inst, min(request.wait_s, 5.0))
        return pb.HoldReply(released=versions is not None, shard_versions=versions or [])

    async def ReportFailure(self, request, context):
        inst = await self._instance(context, "ReportFailure", request)
        self.failures.report(
            str(inst),
            request.kind,
            request.message,
            request.traceback,
            request.minibatch,
        )
        return pb.Ack()

    async def ReportSkipped(self, request, context):
        r = request
        worker = str(await self._instance(context, "ReportSkipped", r))
        self.skipped.skip(worker, r.epoch, r.data_shard, r.shard, r.start, r.end, r.why, r.step)
        return pb.Ack()

    # ------------------------------------------------------------ --strategy allreduce
    async def _rendezvous(self, context):
        if self.c.rendezvous is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this job does not use --strategy allreduce")
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

    async def GetMembership(self, request, context):
        inst = await self._instance(context, "GetMembership", request)
        rdv = await self._rendezvous(context)
        self.c.heard_from(inst)  # a member waiting on a stalled ring is not the one stalling it
        wait_s = min(STEP_WAIT_S, max(0.0, request.wait_s))
        view = await self._wait(rdv.membership, str(inst), request.known_version, wait_s)
        return self._view(view)

    async def StepReady(self, request, context):
        """Served on the event loop, its wait too: every member waits here each step, and on threads of the
        waiting pool a ring of more than WAITING_CALLS members would queue behind it, each wait costing two
        thread switches besides (a pair of members' calls, timed alone: 1.05 ms a step against 1.23).
        `step_ready` never blocks (wait_s 0, the lock is short); a member told to wait is woken by the
        rendezvous's next change (its `changes`)."""
        from elastic_step.master.leases.rendezvous import ABORT, COMMIT, WAIT, Ready

        inst = await self._instance(context, "StepReady", request)
        rdv = await self._rendezvous(context)
        self.c.heard_from(inst)
        r = request
        if r.step_s:
            self.c.worker_spent(inst, r.instance.launch, r.step_s, r.wait_s)
        ready = Ready(
            r.task_id, r.watermark, r.records, r.loss, r.checksum, r.compute_s, max(1, r.steps), tuple(r.step_compute_s)
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STEP_WAIT_S
        while True:
            change = rdv.changes.next_change()  # before the check: a change after it sets this one
            kind, view = rdv.step_ready(str(inst), request.version, request.step, ready)
            if kind != WAIT or (left := deadline - loop.time()) <= 0:
                break
            await asyncio.wait((change,), timeout=left)
        k = {COMMIT: pb.StepReadyReply.COMMIT, ABORT: pb.StepReadyReply.ABORT}.get(kind, pb.StepReadyReply.WAIT)
        return pb.StepReadyReply(kind=k, membership=self._view(view), done=rdv.done)

    async def PullCheckpointState(self, request, context):
        self.calls += 1
        if not rpc.token_ok(self.token, request.token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, rpc.WRONG_TOKEN)
        await self._rendezvous(context)
        state = self.checkpoint_state()
        if state is None or (request.step >= 0 and state.step != request.step):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no checkpoint state of step {request.step} here (the job resumed from "
                f"{'none' if state is None else f'step {state.step}'})",
            )
        return await self._wait(tensors.state_reply, state)

    async def ReportPeerFailure(self, request, context):
        inst = await self._instance(context, "ReportPeerFailure", request)
        await self._rendezvous(context)
        self.c.allreduce_peer_failed(str(inst), request.version, request.peer, request.detail)
        return pb.Ack()


def batch_scheduling() -> None:
    """The calling thread (the event loop's) and gRPC's own threads on SCHED_BATCH (see BATCH_SCHEDULING), and so
    the threads they start later, which inherit it: the completion-queue poller grpc.aio starts from the loop among
    them. The rest of the master, and the processes it launches, keep theirs. Needs no privilege; where the policy
    is not there, nothing changes."""
    if not hasattr(os, "SCHED_BATCH"):
        return
    batch = os.sched_param(0)
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, batch)
    except OSError:  # a sandbox (seccomp) that refuses it: the master serves as before
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(("event_engine", "grpc")):
                    os.sched_setscheduler(int(tid), os.SCHED_BATCH, batch)
        except OSError:  # a thread that ended meanwhile, or a policy this host refuses
            pass


class Server:
    """grpc.aio's server on an event loop thread of its own, stopped as the thread-pool server is: the rest of the
    master is synchronous."""

    def __init__(self, service: MasterService, host: str, port: int):
        self.service = service
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, FULL_GC_EVERY)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="master-grpc", daemon=True)
        self._thread.start()
        self.port = self._run(self._start(host, port))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _start(self, host: str, port: int) -> int:
        if BATCH_SCHEDULING:
            batch_scheduling()  # before gRPC starts its threads from this one
        self._server = grpc.aio.server(options=[*rpc.GRPC_OPTIONS, *rpc.SMALL_CALLS, *PENDING_CALLS])
        pb_grpc.add_MasterServicer_to_server(self.service, self._server)
        bound = self._server.add_insecure_port(f"{host}:{port}")
        await self._server.start()
        if BATCH_SCHEDULING:
            batch_scheduling()  # and those it started from others
        return bound

    async def _settle(self) -> None:
        """The calls' tasks end once gRPC has told them their call is over: give them a moment, so that the loop
        closes with none pending (gRPC's threads tell them late, as batch work)."""
        calls = asyncio.all_tasks() - {asyncio.current_task()}
        if calls:
            await asyncio.wait(calls, timeout=0.5)

    def stop(self, grace: float | None = None) -> None:
        if not self._thread.is_alive():
            return
        self._run(self._server.stop(grace))
        self._run(self._settle())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self.service._waiting.shutdown(wait=False, cancel_futures=True)


def serve(service: MasterService, host: str = "127.0.0.1", port: int = 0) -> tuple[Server, int]:
    server = Server(service, host, port)
    return server, server.port
