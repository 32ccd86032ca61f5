"""Fencing (master/gray/fence.py) and its refusals at the master's service, for real: a gRPC server on 127.0.0.1 and the
workers' MasterClient, refused as a fenced worker sees it."""

from __future__ import annotations

import grpc
import pytest

from elastic_step.backends.api import InstanceId
from elastic_step.instance.api import fenced
from elastic_step.instance.master_client import MasterClient
from elastic_step.master.gray.fence import Fences
from elastic_step.proto import elastic_pb2 as pb
from tests.unit.master.test_service import TOKEN, Master


def test_a_fence_covers_every_launch_up_to_it_and_no_later_one():
    f = Fences()
    assert f.fence("worker-1", 2, "declared hung") and not f.fence("worker-1", 1, "late news")
    assert f.refusal("worker-1", 1).startswith("fenced: worker-1 launch 1 was given up by the master (declared hung)")
    assert f.refusal("worker-1", 2) is not None
    assert f.refusal("worker-1", 3) is None  # its successor
    assert f.refusal("worker-2", 1) is None  # another worker
    assert f.refusal("worker-1", 0) is None  # a call that names no launch is never refused
    assert not f.fence("worker-3", 0, "no launch")
    assert f.summary() == {"fenced": {"worker-1": {"launch": 2, "why": "declared hung", "refused": 2}}, "refused": 2}


@pytest.fixture
def master():
    m = Master()
    yield m
    m.close()


def launch_of(m: Master, index: int, launch: int) -> MasterClient:
    c = MasterClient(m.address, TOKEN, "worker", index, launch)
    m.clients.append(c)
    return c


def test_a_fenced_launch_is_refused_at_every_call_and_its_successor_is_not(master):
    inst = InstanceId("worker", 0)
    master.coord.membership.launched(inst, relaunch=False)
    zombie = launch_of(master, 0, 1)
    zombie.register()
    assert zombie.get_task().kind == zombie.get_task().TASK
    assert master.coord.fence(inst, "declared hung: no progress for 7 s (bound 6 s)") == 1
    assert master.coord.fence(inst, "again") == 0  # once per launch
    for call in (zombie.register, zombie.get_task, lambda: zombie.report(0, 8, 8, 0.5, False), zombie.heartbeat):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert fenced(refused.value).startswith("fenced: worker-0 launch 1 was given up by the master (declared hung")
    assert master.coord.fences.fenced["worker-0"].refused == 4
    kinds = [(e["kind"], e["instance"]) for e in master.coord.timeline.events]
    assert kinds.count(("fenced", "worker-0")) == 1 and kinds.count(("fence_refused", "worker-0")) == 1
    master.coord.membership.launched(inst, relaunch=True)
    successor = launch_of(master, 0, 2)
    successor.register()  # not refused
    # A pod a previous master launched (its 5th launch), kept and adopted by this master: the count rises to it.
    launch_of(master, 0, 5).register()
    assert master.coord.membership.members[inst].launches == 5 and master.coord.fence(inst, "lost") == 5
    assert fenced(RuntimeError("an error of its own")) is None


def test_a_fenced_launch_is_refused_on_its_stream_as_on_its_unary_calls(master):
    inst = InstanceId("worker", 0)
    master.coord.membership.launched(inst, relaunch=False)
    zombie = launch_of(master, 0, 1)
    zombie.register()
    t = zombie.get_task().task
    assert zombie.session.opened == 1
    master.coord.fence(inst, "declared hung: no progress for 7 s (bound 6 s)")
    me = {"token": TOKEN, "instance": zombie.me}
    requests = {
        "GetTask": pb.GetTaskRequest(**me),
        "ReportProgress": pb.ProgressReport(**me, task_id=t.task_id, watermark=t.start + 8, records=8),
        "Heartbeat": pb.HeartbeatRequest(**me),
    }
    for calls in (zombie.session, zombie.stub):
        for name, request in requests.items():
            with pytest.raises(grpc.RpcError) as refused:
                getattr(calls, name)(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
            assert fenced(refused.value).startswith("fenced: worker-0 launch 1 was given up by the master (declared")
    assert master.coord.fences.fenced["worker-0"].refused == 6
    assert zombie.session.opened == 1  # refused call by call, never cut off
    assert master.ledger.records_committed_total() == 0


def test_a_refusal_is_found_under_the_errors_raised_from_it():
    try:
        try:
            raise RuntimeError("PushFailed: fenced: worker-1 launch 1 was given up by the master")
        except RuntimeError as e:
            raise ValueError("the push thread failed") from e
    except ValueError as e:
        assert fenced(e) == "fenced: worker-1 launch 1 was given up by the master"
