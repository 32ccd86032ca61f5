"""What the master makes of the end of an instance it gave up (master/gray/), with a real coordinator and a real
local backend: a hung worker's end is a loss, whatever its exit code; a fenced worker's own exit is a loss, never a
crash; a worker lost is fenced before its lease is requeued; a clean exit is left as it is."""

from __future__ import annotations

import pytest

from elastic_step.backends.api import EventKind, InstanceEvent, InstanceId
from elastic_step.backends.local import LocalBackend
from elastic_step.fault_hooks import JobFaults
from elastic_step.instance.api import EXIT_FENCED
from elastic_step.master.gray.hang import HangBounds
from elastic_step.master.gray.policy import GrayFailures
from elastic_step.master.leases.coordinator import Coordinator
from elastic_step.master.leases.ledger import Ledger, ShardInfo
from elastic_step.master.relaunch import RelaunchPolicy

W0, W1 = InstanceId("worker", 0), InstanceId("worker", 1)


@pytest.fixture
def gray(tmp_path):
    coord = Coordinator(Ledger([ShardInfo("s", 1000)], 100, 1, 10), num_ps=0, bounds=HangBounds(1.0))
    for inst in (W0, W1):
        coord.membership.launched(inst, relaunch=False)
        coord.register(inst, "")
    backend = LocalBackend(tmp_path / "logs")
    retire = RelaunchPolicy(3).retire
    yield (
        coord,
        GrayFailures(coord, backend, JobFaults(), retire=retire, token="token", allreduce=True, bounds=HangBounds(1.0)),
    )
    backend.close()


def test_the_end_of_a_worker_given_up_is_a_loss_and_a_loss_is_fenced(gray):
    coord, g = gray
    g._hung.add(W0)  # as tick leaves it once it declared worker-0 hung
    ev = g.on_end(InstanceEvent(EventKind.EXITED, W0, exit_code=-9))
    assert (ev.kind, ev.detail) == (EventKind.LOST, "declared hung, then exit code -9")
    assert coord.fences.fenced["worker-0"].launch == 1  # fenced on its end, as every loss is
    ev = g.on_end(InstanceEvent(EventKind.EXITED, W1, exit_code=EXIT_FENCED))
    assert (ev.kind, ev.detail) == (EventKind.LOST, f"fenced, then exit code {EXIT_FENCED}")
    clean = InstanceEvent(EventKind.EXITED, W1, exit_code=0)
    assert g.on_end(clean) is clean


def test_a_hung_worker_is_fenced_before_it_is_declared_and_not_while_an_evaluation_holds_the_clocks(gray):
    coord, g = gray
    lease = coord.get_task(W1)
    assert coord.report_progress(W1, lease.task.task_id, lease.start + 10, 0.0, False)  # its clock starts
    for t in range(5):  # an evaluation holds every clock, however long
        g.tick(float(t), evaluating=True)
    assert "worker-1" not in coord.fences.fenced
    for t in range(5, 9):  # each tick counts at most a second: past the 1 s bound by the third
        g.tick(float(t), evaluating=False)
    fenced, declared = (
        [i for i, e in enumerate(coord.timeline.events) if e["kind"] == kind and e["instance"] == "worker-1"]
        for kind in ("fenced", "hung")
    )
    assert fenced and declared and fenced[0] < declared[0], coord.timeline.events
    assert "worker-0" not in coord.fences.fenced  # it holds no lease: its clock never ran
    ev = g.on_end(InstanceEvent(EventKind.LOST, W1, detail="killed"))
    assert ev.detail == "declared hung, then killed"
