"""The master's gRPC service, for real: a server on 127.0.0.1 and the workers' MasterClient."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from elastic_step.backends.api import EventKind, InstanceEvent, InstanceId
from elastic_step.instance.master_client import MasterClient
from elastic_step.master import service
from elastic_step.master.failures import FailureReports
from elastic_step.master.leases.coordinator import Coordinator
from elastic_step.master.leases.ledger import Ledger, ShardInfo
from elastic_step.master.service import TURN_GRID_S, Admission, MasterService, serve
from elastic_step.master.skipped import SkippedMinibatches
from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import rpc

TOKEN = "right-token"
MINIBATCH = 8
TASK = pb.GetTaskResponse


class Master:
    def __init__(
        self,
        rows=(40, 24),
        records_per_task=16,
        epochs=2,
        max_workers=1,
        pushes_in_flight=1,
        num_ps=0,
        minibatches_per_push=1,
        min_workers=1,
        ring=False,
    ):
        self.ledger = Ledger(
            [ShardInfo(f"s{i}", n) for i, n in enumerate(rows)], records_per_task, epochs, minibatch_size=MINIBATCH
        )
        # ring: --strategy allreduce, a rendezvous of up to max_workers members
        self.coord = Coordinator(
            self.ledger, num_ps=num_ps, min_workers=min_workers, ring_max_workers=max_workers if ring else None
        )
        self.failures = FailureReports(self.coord.timeline, job_failed=self.coord.finished.set)
        self.skipped = SkippedMinibatches(self.coord.timeline)
        self.service = MasterService(
            self.coord,
            TOKEN,
            "job-1",
            MINIBATCH,
            "model.py",
            max_workers,
            pushes_in_flight,
            minibatches_per_push,
            failures=self.failures,
            skipped=self.skipped,
        )
        self.server, self.port = serve(self.service)
        self.address = f"127.0.0.1:{self.port}"
        self.clients: list[MasterClient] = []

    def client(self, index: int, token: str = TOKEN, role: str = "worker") -> MasterClient:
        c = MasterClient(self.address, token, role, index)
        self.clients.append(c)
        return c

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.server.stop(None)


@pytest.fixture
def master():
    m = Master()
    yield m
    m.close()


@pytest.fixture
def even_master():
    """Every task is exactly two minibatches, whichever the shuffle hands out first."""
    m = Master(rows=(48,), records_per_task=2 * MINIBATCH, epochs=1)
    yield m
    m.close()


def _train(client: MasterClient, reply: pb.GetTaskResponse, upto: int | None = None) -> None:
    """Report the leased task minibatch by minibatch (boundaries from task_start), up to `upto`."""
    t = reply.task
    seq = t.start
    while seq < (t.end if upto is None else upto):
        hi = min(t.end, t.task_start + ((seq - t.task_start) // MINIBATCH + 1) * MINIBATCH)
        assert not client.report(t.task_id, hi, hi - seq, 0.5, False).stop
        seq = hi


# ---------------------------------------------------------------------------- authentication


def test_a_wrong_token_is_unauthenticated_on_every_rpc(master):
    good = master.client(0)
    good.register()
    lease = good.get_task()
    assert lease.kind == TASK.TASK
    for token in ("wrong-token", "", TOKEN + "x", TOKEN[:-1]):
        bad = master.client(1, token=token)
        me = bad.me
        calls = {
            "Register": lambda: bad.register(),
            # The hot calls go on the Session stream; their unary twins stay for clients that do not stream.
            "Heartbeat": lambda: bad.stub.Heartbeat(pb.HeartbeatRequest(token=token, instance=me), timeout=10),
            "GetTask": lambda: bad.stub.GetTask(pb.GetTaskRequest(token=token, instance=me), timeout=10),
            "ReportProgress": lambda: bad.stub.ReportProgress(
                pb.ProgressReport(
                    token=token, instance=me, task_id=lease.task.task_id, watermark=lease.task.start + MINIBATCH
                ),
                timeout=10,
            ),
            "Session": lambda: bad.report(lease.task.task_id, lease.task.start + MINIBATCH, MINIBATCH, 0.0, False),
            # MasterClient.fail swallows errors by design: call the stub itself.
            "ReportFailure": lambda: bad.stub.ReportFailure(
                pb.FailureReport(token=token, instance=me, kind="internal", message="boom"), timeout=10
            ),
            "ReportSkipped": lambda: bad.stub.ReportSkipped(pb.SkipReport(token=token, instance=me), timeout=10),
            "GetMembership": lambda: bad.stub.GetMembership(pb.MembershipRequest(token=token, instance=me), timeout=10),
            "StepReady": lambda: bad.stub.StepReady(pb.StepReadyRequest(token=token, instance=me), timeout=10),
            "ReportPeerFailure": lambda: bad.stub.ReportPeerFailure(
                pb.PeerFailureReport(token=token, instance=me, peer="worker-0"), timeout=10
            ),
            "Hold": lambda: bad.stub.Hold(pb.HoldRequest(token=token, instance=me), timeout=10),
            "PullCheckpointState": lambda: bad.stub.PullCheckpointState(pb.StateRequest(token=token), timeout=10),
        }
        assert set(calls) == set(pb.DESCRIPTOR.services_by_name["Master"].methods_by_name)
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
    # Nothing the impostors sent reached the coordinator.
    assert InstanceId("worker", 1) not in master.coord.membership.members
    assert master.failures.failure is None and not master.coord.finished.is_set()
    assert master.ledger.records_committed_total() == 0
    assert list(master.ledger.leases) == ["worker-0"]


def test_a_malformed_instance_is_invalid_argument(master):
    bad = master.client(0, role="scheduler")
    with pytest.raises(grpc.RpcError) as err:
        bad.register()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux's scheduling policies")
def test_the_masters_event_loop_and_grpcs_threads_run_as_batch_work_and_the_rest_keep_their_policy(master):
    def policies(prefix):
        found = set()
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(prefix):
                    found.add(os.sched_getscheduler(int(tid)))
        return found

    assert os.sched_getscheduler(master.server._thread.native_id) == os.SCHED_BATCH
    assert policies("event_engine") == {os.SCHED_BATCH}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # this thread, as the master's main thread, keeps its own
    client = master.client(0)
    client.register()
    assert client.get_task().kind == TASK.TASK


# ---------------------------------------------------------------------------- the task flow


def test_a_worker_started_beside_the_shards_learns_their_addresses_only_once_they_are_open():
    """Workers start with the PS, not after it: until every shard is up (and restored), a worker's
    registration answers empty addresses, and asking again is not a second registration."""
    m = Master(num_ps=2)
    try:
        worker, ps0, ps1 = m.client(0), m.client(0, role="ps"), m.client(1, role="ps")
        assert list(worker.register().ps_addresses) == ["", ""]
        ps0.register("127.0.0.1:1001")
        ps1.register("127.0.0.1:1002")
        assert m.coord.ps_ready.is_set()
        assert list(worker.register().ps_addresses) == ["", ""]  # up, but not yet open
        m.coord.open_shards()
        assert list(worker.register().ps_addresses) == ["127.0.0.1:1001", "127.0.0.1:1002"]
        assert [e["instance"] for e in m.coord.timeline.events if e["kind"] == "registered"] == [
            "worker-0",
            "ps-0",
            "ps-1",
        ]
    finally:
        m.close()


def test_register_get_task_report_commits_every_record_and_then_done(master):
    client = master.client(0)
    reg = client.register()
    assert (reg.job_id, reg.minibatch_size, reg.model_def, list(reg.ps_addresses)) == (
        "job-1",
        MINIBATCH,
        "model.py",
        [],
    )
    seen: dict[int, list[tuple[str, int, int]]] = {0: [], 1: []}
    for _ in range(100):
        reply = client.get_task()
        if reply.kind == TASK.DONE:
            break
        assert reply.kind == TASK.TASK
        t = reply.task
        assert t.start == t.task_start and t.end - t.start <= 16 and t.task_start % MINIBATCH == 0
        assert t.epoch == master.ledger.epoch
        seen[t.epoch].append((t.shard, t.start, t.end))
        _train(client, reply)
    else:
        pytest.fail("the master never said DONE")
    for epoch in (0, 1):
        assert sorted(seen[epoch]) == [("s0", 0, 16), ("s0", 16, 32), ("s0", 32, 40), ("s1", 0, 16), ("s1", 16, 24)]
    assert [a.as_dict() for a in master.ledger.accounts] == [
        {"epoch": e, "records": 64, "committed": 64, "lost": 0, "double_applied": 0, "requeued": 0} for e in (0, 1)
    ]
    assert master.coord.finished.is_set()
    # DONE is final, for this worker and any other.
    assert client.get_task().kind == TASK.DONE
    late = master.client(1)
    late.register()
    assert late.get_task().kind == TASK.DONE
    assert master.failures.failure is None and master.ledger.records_committed_total() == 128


def test_the_current_lease_is_handed_out_again_until_it_is_finished(even_master):
    master = even_master
    client = master.client(0)
    client.register()
    first = client.get_task()
    _train(client, first, upto=first.task.start + MINIBATCH)
    again = client.get_task()
    assert again.task.task_id == first.task.task_id
    assert (again.task.start, again.task.task_start) == (first.task.start + MINIBATCH, first.task.start)


def test_wait_while_the_epoch_is_leased_out_but_not_committed():
    m = Master(rows=(16,), records_per_task=16, epochs=2)
    try:
        a, b = m.client(0), m.client(1)
        a.register()
        b.register()
        lease = a.get_task()
        wait = b.get_task()
        assert wait.kind == TASK.WAIT and wait.retry_after_s > 0
        _train(a, lease)
        nxt = b.get_task()
        assert nxt.kind == TASK.TASK and nxt.task.epoch == 1
    finally:
        m.close()


# ---------------------------------------------------------------------------- refusals


def test_a_report_for_a_task_the_worker_does_not_hold_is_refused(master):
    a, b = master.client(0), master.client(1)
    a.register()
    b.register()
    ta = a.get_task().task
    tb = b.get_task().task
    assert b.report(ta.task_id, ta.start + MINIBATCH, MINIBATCH, 0.1, False).stop  # a's task
    assert a.report(10_000, MINIBATCH, MINIBATCH, 0.1, False).stop  # no such task
    assert a.report(ta.task_id, ta.end + MINIBATCH, MINIBATCH, 0.1, False).stop  # past its end
    never = master.client(2)
    never.register()
    assert never.report(ta.task_id, ta.start + MINIBATCH, MINIBATCH, 0.1, False).stop  # holds nothing
    assert master.ledger.records_committed_total() == 0
    assert [e["instance"] for e in master.coord.timeline.events if e["kind"] == "refused"] == [
        "worker-1",
        "worker-0",
        "worker-0",
        "worker-2",
    ]
    # The holders still hold their leases and may go on.
    assert not a.report(ta.task_id, ta.start + MINIBATCH, MINIBATCH, 0.1, False).stop
    assert not b.report(tb.task_id, tb.start + MINIBATCH, MINIBATCH, 0.1, False).stop
    assert master.ledger.records_committed_total() == 2 * MINIBATCH


def test_a_lost_workers_late_report_is_refused_and_its_remainder_goes_to_the_next(even_master):
    master = even_master
    a, b = master.client(0), master.client(1)
    a.register()
    b.register()
    first = a.get_task()
    _train(a, first, upto=first.task.start + MINIBATCH)
    remainder = master.coord.on_instance_event(InstanceEvent(EventKind.LOST, InstanceId("worker", 0)))
    assert remainder == (first.task.start + MINIBATCH, first.task.end)
    assert a.report(first.task.task_id, first.task.start + 2 * MINIBATCH, MINIBATCH, 0.1, False).stop
    nxt = b.get_task()
    assert nxt.task.task_id == first.task.task_id
    assert (nxt.task.start, nxt.task.end, nxt.task.task_start) == (*remainder, first.task.start)
    _train(b, nxt)
    assert master.ledger.account.committed == first.task.end - first.task.start
    assert master.ledger.account.requeued == remainder[1] - remainder[0]
    assert master.ledger.account.double_applied == 0


@pytest.mark.parametrize("max_workers, interval", [(2, 0.05), (50, 0.05), (400, 0.4)])
def test_a_larger_job_asks_its_workers_for_slower_reports(max_workers, interval):
    # The master's load from reports stays flat as the job grows (bench/master_capacity.py).
    m = Master(max_workers=max_workers)
    try:
        assert m.client(0).register().report_interval_s == pytest.approx(interval)
    finally:
        m.close()


@pytest.mark.parametrize("max_workers, depth", [(1, 1), (1, 2), (8, 2)])
def test_workers_keep_the_jobs_pushes_in_flight_whatever_its_size(max_workers, depth):
    # The job's --pushes-in-flight reaches every worker: a choice of algorithm, not of the job's size.
    m = Master(max_workers=max_workers, pushes_in_flight=depth)
    try:
        assert m.client(0).register().pushes_in_flight == depth
    finally:
        m.close()


def test_workers_get_the_jobs_minibatches_per_push():
    m = Master(minibatches_per_push=8)
    try:
        reply = m.client(0).register()
        assert (reply.minibatches_per_push, reply.minibatch_size) == (8, MINIBATCH)
    finally:
        m.close()


def test_the_checkpoint_barrier_holds_leases_and_is_reached_only_when_every_leaseholder_waits(master):
    a, b, c = master.client(0), master.client(1), master.client(2)
    for w in (a, b, c):
        w.register()
    ta, tb = a.get_task().task, b.get_task().task
    master.coord.begin_hold()
    # No new work while holding; c holds no lease, so the barrier does not wait for it.
    assert c.get_task().kind == TASK.WAIT
    assert b.get_task().task.task_id == tb.task_id  # a lease held is handed out again
    reply = a.report(ta.task_id, ta.start + MINIBATCH, MINIBATCH, 0.1, False)
    assert reply.hold and not reply.stop  # reports still commit, and ask to hold
    assert not master.coord.hold_reached()
    waiting = threading.Thread(target=a.hold, args=(threading.Event(),))
    waiting.start()
    wait_until(lambda: "worker-0" in master.coord.held)
    assert not master.coord.hold_reached()  # b still has pushes to report
    b.report(tb.task_id, tb.start + MINIBATCH, MINIBATCH, 0.1, False)
    also = threading.Thread(target=b.hold, args=(threading.Event(),))
    also.start()
    wait_until(master.coord.hold_reached)
    master.coord.end_hold()
    for held in (waiting, also):
        held.join(10)
        assert not held.is_alive()  # released
    assert c.get_task().kind == TASK.TASK
    assert master.ledger.records_committed_total() == 2 * MINIBATCH


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


def test_a_skipped_minibatch_is_counted_once_and_an_internal_failure_waits_for_the_relaunch_policy(master):
    from elastic_step.worker.records import Records

    w0, w1 = master.client(0), master.client(1)
    at = Records("s0", 0, 1, 16, 24)
    w0.report_skipped(at, "the loss became nan")
    w1.report_skipped(at, "the loss became nan")  # the same minibatch again: a successor, a retried step
    w1.report_skipped(Records("s1", 1, 1, 0, 8), "the gradient of 'dense/kernel' became inf", step=7)
    summary = master.skipped.summary()
    assert (summary["minibatches"], summary["records"]) == (2, 16)
    assert summary["skipped"][0] == {
        "worker": "worker-0",
        "epoch": 1,
        "data_shard": "s0",
        "start": 16,
        "end": 24,
        "why": "the loss became nan",
    }
    assert summary["skipped"][1]["step"] == 7
    # An error not known to be the user's does not fail the job: the relaunch policy decides when w1 ends.
    w1.fail("internal", OSError("disk gone"), minibatch=str(at))
    assert master.failures.failure is None
    report = master.failures.take("worker-1")
    assert report["message"] == "disk gone" and report["minibatch"] == str(at) and "OSError" in report["traceback"]
    assert master.failures.take("worker-1") is None
    w0.fail("data_error", ValueError("bad row"), minibatch=str(at))
    assert master.failures.failure["minibatch"] == str(at) and master.coord.finished.is_set()


class QueuedFor:
    """A served call's context as far as Admission reads it: what is left of its deadline."""

    def __init__(self, waited_s: float):
        self.left = rpc.CALL_TIMEOUT_S - waited_s

    def time_remaining(self) -> float:
        return self.left


def test_admission_sheds_only_past_its_target_and_gives_each_shed_worker_a_turn_of_its_own():
    adm = Admission(target_s=0.1, joins_per_s=500.0)
    for i in range(50):
        adm.observe(QueuedFor(0.01))
        assert adm.retry_after(("early", i), now=100.0) == 0.0  # calls served at once are never shed
    for _ in range(200):
        adm.observe(QueuedFor(2.0))  # calls now queue for 2 s
    now = 200.0
    turns = [now + adm.retry_after(i, now=now) for i in range(1000)]  # a burst of 1,000 joining at once
    assert adm.shed == 1000
    assert turns == sorted(turns) and min(turns) > now + 1.9  # after the calls queued now
    # 500 a second: the last turn about 2 s after the first, on a grid, so that each turn's workers come together
    assert 1.9 <= max(turns) - min(turns) <= 2.1
    assert all(abs(t / TURN_GRID_S - round(t / TURN_GRID_S)) < 1e-6 for t in turns)
    assert 15 <= max(turns.count(t) for t in turns) <= 55

    # Back at its turn, a worker joins though calls still queue; back before it, it is given a new turn.
    assert adm.retry_after(7, now=turns[7]) == 0.0
    assert adm.retry_after(999, now=turns[999] - 1.0) > 1.0 and adm.shed == 1001
    before = adm.wait
    adm.observe(QueuedFor(-60.0))  # a call with a longer deadline than the usual one says nothing of the queue
    adm.observe(QueuedFor(1.0), deadline_s=rpc.SESSION_DEADLINE_S)  # nor a stream opened with a short one
    assert adm.wait == before


def test_a_new_session_stream_tells_admission_how_long_it_queued(master):
    adm = master.service.admission
    adm.target_s, adm.wait = 10.0, 1.0  # an estimate the observation moves (under the target: no one is shed)
    master.client(0).register()  # on the worker's Session stream, opened with rpc.SESSION_DEADLINE_S
    # Observed, and served at once: the stream's deadline reached the master whole (gRPC rounds timeouts up, a
    # day stays a day), so the estimate moved towards a wait of under 0.5 s.
    assert 1.0 - 0.02 < adm.wait < 1.0 - 0.02 * 0.5


def test_a_master_with_calls_queueing_holds_a_joining_workers_register_until_its_turn(master):
    adm = master.service.admission
    adm.target_s, adm.wait = 0.05, 2.0  # as if calls had queued 2 s: past the target, the turn about 2 s away
    probe = master.client(0)
    answer, calls = {}, master.service.calls
    held = threading.Thread(target=lambda: answer.update(info=probe.register()))
    held.start()
    time.sleep(0.5)
    assert held.is_alive() and InstanceId("worker", 0) not in master.coord.membership.members  # not before its turn
    held.join(timeout=30)
    assert answer["info"].retry_after_s == 0 and answer["info"].minibatch_size == MINIBATCH
    assert master.service.calls == calls + 1  # one Register, held: the worker did not have to call again
    assert adm.shed == 1 and master.coord.membership.members[InstanceId("worker", 0)].state == "registered"
    assert probe.get_task().kind == TASK.TASK


def test_a_master_with_calls_queueing_tells_a_joining_worker_whose_turn_is_far_to_come_back_and_it_does(
    master, monkeypatch
):
    monkeypatch.setattr(service, "HOLD_FOR_TURN_S", 0.0)  # every turn is too far to hold the call for
    adm = master.service.admission
    adm.target_s, adm.wait = 0.05, 0.06  # as if calls had queued 60 ms: past the target
    probe = master.client(0)
    told = probe.stub.Register(pb.RegisterRequest(token=TOKEN, instance=probe.me), timeout=rpc.CALL_TIMEOUT_S)
    assert told.retry_after_s > 0 and not told.minibatch_size  # not registered: nothing else in the answer
    assert InstanceId("worker", 0) not in master.coord.membership.members

    joining = master.client(1)
    info = joining.register()  # told to come back, and does: back at its turn it joins, though calls still queue
    assert adm.shed == 2  # each told once
    assert info.retry_after_s == 0 and info.minibatch_size == MINIBATCH
    assert master.coord.membership.members[InstanceId("worker", 1)].state == "registered"
    assert joining.get_task().kind == TASK.TASK

    adm.wait, shed = 10.0, adm.shed  # a worker already in is never shed, however long calls queue
    assert joining.register().retry_after_s == 0 and adm.shed == shed


# ---------------------------------------------------------------------------- allreduce step calls
def test_members_step_calls_wait_on_the_event_loop_woken_by_the_commit_and_by_a_checkpoints_release(monkeypatch):
    """Three members' StepReady over gRPC, with one thread for the master's waiting calls: the first two wait in
    the master (no thread of their own, so a ring larger than the pool does not queue behind it) until the third's
    commits the step; a step held by a checkpoint commits when the checkpoint, on another thread, releases it. The
    long poll is made longer than the test may wait: a call not woken would time the test out."""
    monkeypatch.setattr(service, "STEP_WAIT_S", 120.0)
    monkeypatch.setattr(service, "WAITING_CALLS", 1)
    m = Master(max_workers=3, min_workers=3, ring=True)  # version 1 is all three
    try:
        members = [m.client(i) for i in range(3)]
        for i, c in enumerate(members):
            c.register(f"127.0.0.1:{i + 1}")

        def ready(client: MasterClient, step: int) -> pb.StepReadyReply:
            request = pb.StepReadyRequest(token=TOKEN, instance=client.me, version=1, step=step, task_id=-1)
            return client.stub.StepReady(request, timeout=60)

        def in_thread(client: MasterClient, step: int) -> tuple[threading.Thread, dict]:
            out: dict = {}
            t = threading.Thread(target=lambda: out.update(reply=ready(client, step)))
            t.start()
            return t, out

        def committed(waiting) -> None:
            for t, out in waiting:
                t.join(30)
                assert not t.is_alive() and out["reply"].kind == pb.StepReadyReply.COMMIT

        waiting = [in_thread(c, 1) for c in members[:2]]
        wait_until(lambda: set(m.coord.rendezvous.ready) == {"worker-0", "worker-1"})
        assert ready(members[2], 1).kind == pb.StepReadyReply.COMMIT
        committed(waiting)

        m.coord.begin_hold()  # a checkpoint: no step commits until it is cut
        waiting = [in_thread(c, 2) for c in members]
        wait_until(lambda: len(m.coord.rendezvous.ready) == 3)
        assert m.coord.rendezvous.committed_step == 1
        m.coord.end_hold()  # from this thread, not the master's loop
        committed(waiting)
        assert m.coord.rendezvous.committed_step == 2
    finally:
        m.close()
