"""The coordinator: its progress samples (the report's and TensorBoard's time series), a straggler's work handed
over to an idle worker, and the job's throughput."""

from __future__ import annotations

import time

from elastic_step.backends.api import EventKind, InstanceEvent, InstanceId
from elastic_step.master.leases.coordinator import Coordinator
from elastic_step.master.leases.ledger import Ledger, ShardInfo

W0, W1 = InstanceId("worker", 0), InstanceId("worker", 1)


def test_a_worker_lost_and_back_between_two_samples_still_shows_as_a_dip():
    coord = Coordinator(Ledger([ShardInfo("s", 1000)], 100, 1, 10), num_ps=0)
    for w in (W0, W1):
        coord.membership.launched(w, relaunch=False)
        coord.membership.registered(w)
    assert coord.sample(0.0)["workers_alive"] == 1  # the fewest since the start: worker-1 came second
    assert coord.sample(0.0)["workers_alive"] == 2
    # Between samples: worker-0 is killed, relaunched and registered again (a forked relaunch: under a second).
    coord.membership.on_event(InstanceEvent(EventKind.LOST, W0, exit_code=-9, time=time.time()))
    coord.membership.launched(W0, relaunch=True)
    coord.membership.registered(W0)
    assert len(coord.membership.training()) == 2
    assert coord.sample(0.0)["workers_alive"] == 1  # the fewest since the previous sample
    assert coord.sample(0.0)["workers_alive"] == 2  # and back


def test_an_idle_worker_takes_a_stragglers_tail_and_the_stragglers_report_past_the_cut_stops_it():
    coord = Coordinator(Ledger([ShardInfo("s", 640)], 640, 1, 32), num_ps=1)
    coord.training_started = True
    for w in (W0, W1):
        coord.membership.launched(w, relaunch=False)
        coord.membership.registered(w)
    slow = coord.get_task(W0)
    assert coord.get_task(W1) is None  # one task, leased: nothing for worker-1, and no pace known yet
    for n in range(1, 5):  # worker-0 at 32 records a report, and worker-1's pace, far faster, from another lease
        coord.stragglers.reported("worker-0", slow.task.task_id, 32, n * 1.0)
        coord.stragglers.reported("worker-1", 99, 320, n * 1.0)
    assert coord.report_progress(W0, slow.task.task_id, 64, 0.1, False)
    tail = coord.get_task(W1)
    straggler = [e for e in coord.timeline.events if e["kind"] == "straggler"]
    assert [(e["instance"], e["records"]) for e in straggler] == [("worker-0", 640 - tail.start)]
    assert (
        tail.task.task_id == slow.task.task_id
        and tail.start > 64
        and coord.ledger.leases["worker-0"].task.end == tail.start
    )
    # worker-0 trained on past its cut before it knew: below the cut is committed, and it is told to stop.
    assert not coord.report_progress(W0, slow.task.task_id, tail.start + 32, 0.1, False)
    assert (
        coord.ledger.account.committed == tail.start and [e["kind"] for e in coord.timeline.events][-1] == "lease_over"
    )
    assert coord.report_progress(W1, tail.task.task_id, 640, 0.1, True)
    assert coord.ledger.done and coord.finished.is_set() and coord.ledger.accounts[0].double_applied == 0


def test_throughput_counts_only_what_was_trained_within_its_span():
    # The first commit's records (a first call of 5 minibatches here; a resumed job's earlier ones too) were trained
    # before the span from the first commit to the last began: only the 3 commits after it count, 192 records in 2 s.
    coord = Coordinator(Ledger([ShardInfo("s", 1000)], 1000, 1, 64), num_ps=1)
    coord.training_started = True
    coord.membership.launched(W0, relaunch=False)
    coord.membership.registered(W0)
    lease = coord.get_task(W0)
    assert coord.report_progress(W0, lease.task.task_id, 320, 0.1, False)
    assert coord.throughput() == 0.0
    for i, watermark in enumerate((384, 448, 512), start=1):
        assert coord.report_progress(W0, lease.task.task_id, watermark, 0.1, False)
        coord.pace.last_commit_at = coord.pace.first_commit_at + i * (2 / 3)
    assert abs(coord.throughput() - 192 / 2) < 1e-9
