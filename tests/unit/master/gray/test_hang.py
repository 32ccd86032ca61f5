"""Hang detection's bound and clock (master/gray/hang.py), and the coordinator's decisions on it: who is hung,
who is only waiting, and what a declared-hung worker leaves behind."""

from __future__ import annotations

import pytest

from elastic_step.backends.api import InstanceId
from elastic_step.master.gray.hang import (
    FACTOR,
    FLOOR_S,
    MAX_TICK_S,
    STARTUP_FACTOR,
    STARTUP_FLOOR_S,
    HangBounds,
    HangWatch,
    Hung,
)
from elastic_step.master.leases.coordinator import Coordinator
from elastic_step.master.leases.ledger import Ledger, ShardInfo


def run(watch: HangWatch, start: float, seconds: float, running=("worker-0",), step: float = 0.1) -> list:
    """Tick the watch every `step` seconds for `seconds` from `start`; every Hung it reported."""
    late, t = [], start
    while t < start + seconds - 1e-9:
        t += step
        late += watch.tick(t, running)
    return late


def test_the_measured_bound_is_the_floor_for_a_fast_worker_and_its_own_pace_for_a_slow_one():
    watch = HangWatch()
    assert watch.bound("worker-0") == FLOOR_S  # no pace yet
    both = ["worker-0", "worker-1"]
    watch.tick(0.0, both)
    watch.committed("worker-0")
    watch.committed("worker-1")
    for i in range(1, 401):  # 40 s: worker-0 commits every 0.1 s, worker-1 every 8 s
        assert watch.tick(i / 10, both) == []
        watch.committed("worker-0")
        if i % 80 == 0:
            watch.committed("worker-1")
    assert watch.bound("worker-0") == FLOOR_S
    assert watch.bound("worker-1") == pytest.approx(FACTOR * 8.0)  # 80 s: past the floor
    assert HangWatch(HangBounds(timeout_s=5.0)).bound("worker-1") == 5.0  # --hang-timeout overrides it
    # The shortest any worker gets, whatever its pace (what a slowed worker's pauses stay under: faults/chaos.py).
    assert watch.bounds.least == FLOOR_S and HangBounds(timeout_s=5.0).least == 5.0


def test_a_worker_past_its_bound_is_reported_with_the_figures_and_one_that_commits_never():
    watch = HangWatch(HangBounds(floor_s=3.0))
    watch.tick(0.0, ["worker-0"])
    watch.committed("worker-0")
    t = 0.0
    for _ in range(50):  # 10 s of commits every 0.2 s, slower than the floor's pace: never late
        assert run(watch, t, 0.2) == []
        t += 0.2
        watch.committed("worker-0")
    late = run(watch, t, 4.0)
    assert late and late[0].worker == "worker-0" and late[0].bound_s == 3.0 and late[0].idle_s > 3.0
    assert str(late[0]) == f"no progress for {late[0].idle_s:.1f} s (bound 3 s)"
    assert str(Hung("worker-0", 41.3, 30.0, measured=True)) == "no progress for 41 s (bound 30 s)"
    assert str(Hung("worker-0", 2.14, 2.0, measured=False)) == "no progress for 2.1 s (bound 2 s, --hang-timeout)"


def _fixed(timeout: float) -> HangWatch:
    watch = HangWatch(HangBounds(timeout_s=timeout))
    watch.tick(0.0, ["worker-0"])
    watch.committed("worker-0")
    return watch


def test_the_clock_starts_at_the_first_commit_so_a_long_first_step_is_no_hang():
    watch = HangWatch(HangBounds(timeout_s=1.0))
    assert run(watch, 0.0, 60.0) == []  # a minute of tracing: no commit, no clock
    watch.committed("worker-0")
    assert run(watch, 60.0, 2.0)  # from the first commit on, the bound holds


def test_the_clock_stops_while_the_worker_may_not_progress_and_a_stalled_master_charges_nobody():
    watch = _fixed(5.0)
    assert run(watch, 0.0, 1.5) == []
    assert run(watch, 1.5, 30.0, running=()) == []  # held (a checkpoint, a restore, an evaluation)
    assert run(watch, 31.5, 0.3) == []  # the tick after the pause counts nothing of it
    assert watch.idle("worker-0") == pytest.approx(1.7)
    assert watch.tick(100.0, ["worker-0"]) == []  # the pump stalled 68 s: at most MAX_TICK_S of it counts
    assert watch.idle("worker-0") == pytest.approx(1.7 + MAX_TICK_S)


def test_a_forgotten_worker_s_successor_starts_with_no_clock_and_no_pace():
    watch = HangWatch(HangBounds(floor_s=1.0))
    watch.tick(0.0, ["worker-0"])
    watch.committed("worker-0")
    run(watch, 0.0, 50.0 / FACTOR)
    watch.committed("worker-0")
    assert watch.bound("worker-0") > 1.0
    watch.forget("worker-0")
    assert watch.idle("worker-0") is None and watch.bound("worker-0") == 1.0
    assert run(watch, 10.0, 10.0) == []


# ------------------------------------------------------------------ the coordinator's decisions
def ps_job(timeout: float = 2.0) -> Coordinator:
    coord = Coordinator(Ledger([ShardInfo("s", 1000)], 100, 1, 10), num_ps=1, bounds=HangBounds(timeout))
    for i in (0, 1):
        coord.membership.launched(InstanceId("worker", i), relaunch=False)
        coord.register(InstanceId("worker", i), "")
        coord.get_task(InstanceId("worker", i))
    return coord


def ticks(coord: Coordinator, start: float, seconds: float, **kw) -> list:
    """Tick every 0.1 s for `seconds` from `start`; the workers late at the last tick."""
    late, t = [], start
    while t < start + seconds - 1e-9:
        t += 0.1
        late = coord.hung_workers(t, **kw)
    return late


def test_ps_a_leased_worker_past_its_bound_is_declared_hung_its_remainder_requeued_and_it_gets_no_more_work():
    coord = ps_job()
    w0, w1 = InstanceId("worker", 0), InstanceId("worker", 1)
    lease = coord.ledger.leases["worker-0"]
    coord.hung_workers(0.0)
    assert coord.report_progress(w0, lease.task.task_id, lease.start + 20, 1.0, False)
    other = coord.ledger.leases["worker-1"]
    assert coord.report_progress(w1, other.task.task_id, other.start + 20, 1.0, False)
    assert ticks(coord, 0.0, 1.5) == []
    assert ticks(coord, 1.5, 10.0, paused=True) == []  # an epoch's evaluation: nobody's clock runs
    coord.hung_workers(20.0, paused=True)
    late = ticks(coord, 20.0, 1.0)
    assert [h.worker for h in late] == ["worker-0", "worker-1"]
    hung = late[0]
    remainder = coord.declare_hung(hung, 21.0)
    assert remainder == (lease.start + 20, lease.task.end)  # from its watermark, as for a kill
    assert coord.ledger.queue[0] == (lease.task, lease.start + 20)
    event = next(e for e in coord.timeline.events if e["kind"] == "hung")
    assert event["instance"] == "worker-0" and event["bound_s"] == 2.0 and event["idle_s"] > 2.0
    assert event["detail"] == f"{hung}: declared hung, stopped and replaced"
    assert "(bound 2 s, --hang-timeout)" in str(hung)
    assert coord.timeline.events[-1]["kind"] == "requeued" and coord.timeline.events[-1]["instance"] == "worker-0"
    assert coord.get_task(w0) == "done"  # given up: if it ever runs again, it gets nothing
    assert [h.worker for h in coord.hung_workers(21.1)] == ["worker-1"]  # worker-0's clock is gone


def test_ps_a_worker_waiting_in_a_checkpoint_barrier_is_not_hung_one_that_never_gets_there_is():
    coord = ps_job()
    coord.hung_workers(0.0)
    for i in (0, 1):
        lease = coord.ledger.leases[f"worker-{i}"]
        assert coord.report_progress(InstanceId("worker", i), lease.task.task_id, lease.start + 10, 1.0, False)
    coord.begin_hold()
    coord.held.add("worker-0")  # worker-0 reached the barrier; worker-1 never does (frozen)
    late = ticks(coord, 0.0, 3.0)
    assert {h.worker for h in late} == {"worker-1"}
    coord.declare_hung(late[0], 3.0)
    assert coord.hold_reached()  # the checkpoint no longer waits on it


def test_allreduce_the_silent_member_of_a_stalled_ring_is_hung_not_the_members_waiting_on_it():
    coord = Coordinator(
        Ledger([ShardInfo("s", 1000)], 100, 1, 10), num_ps=0, min_workers=2, bounds=HangBounds(2.0), ring_max_workers=2
    )
    rdv = coord.rendezvous
    workers = [InstanceId("worker", i) for i in (0, 1)]
    for w in workers:
        coord.membership.launched(w, relaunch=False)
        coord.register(w, f"addr-{w.index}")
    assert rdv.version == 1 and len(rdv.members) == 2
    from elastic_step.master.leases.rendezvous import Ready

    coord.hung_workers(0.0)
    for w in workers:  # step 1 commits with no records: neither has traced its model yet, no clock runs
        rdv.step_ready(str(w), 1, 1, Ready(-1, 0, 0, 0.0, 7))
    assert coord.hangs.idle("worker-0") is None and coord.hangs.idle("worker-1") is None
    for w in workers:  # step 2, with records: both clocks start
        rdv.step_ready(str(w), 1, 2, Ready(-1, 0, 32, 1.0, 7))
    assert coord.hangs.idle("worker-0") == 0.0
    for w in workers:
        coord.membership.members[w].last_seen = 0.0  # this test's clock
    # worker-1 freezes in step 3's collective; worker-0 waits on it, asking the master about the ring.
    late, t = [], 0.0
    for _ in range(40):
        t += 0.1
        coord.membership.members[workers[0]].last_seen = t
        late += coord.hung_workers(t)
    assert late and {h.worker for h in late} == {"worker-1"}
    assert coord.hangs.idle("worker-0") > 2.0  # its clock ran past the bound too: it was heard from
    coord.declare_hung(late[0], t)
    assert [n for n, _ in rdv.members] == ["worker-0"]  # the ring goes on without it


# ------------------------------------------------------------------ the start-up bound
def test_a_worker_that_never_commits_is_hung_after_the_start_up_bound_which_the_job_s_first_steps_lengthen():
    watch = HangWatch(HangBounds(timeout_s=2.0))
    assert watch.startup_bound() == STARTUP_FLOOR_S  # --hang-timeout does not shorten it
    assert run(watch, 0.0, STARTUP_FLOOR_S - 1, step=0.5) == []  # minutes of a first step: no alarm
    late = run(watch, STARTUP_FLOOR_S - 1, 2.0, step=0.5)
    assert late and late[0].what == "first commit" and late[0].bound_s == STARTUP_FLOOR_S
    assert str(late[0]).startswith("no first commit for") and "(start-up bound 180 s)" in str(late[0])
    # Another worker's first commit came after 99.5 s of its clock (its first tick counts nothing): 3 × that.
    other = HangWatch()
    run(other, 0.0, 100.0, running=("worker-1",), step=0.5)
    other.committed("worker-1")
    assert other.starting("worker-1") is None and other.startup_bound() == pytest.approx(STARTUP_FACTOR * 99.5)
    assert HangWatch(HangBounds(timeout_s=600.0)).startup_bound() == 600.0  # a longer --hang-timeout lengthens it
    # A forgotten worker's successor starts its own start-up clock.
    other.forget("worker-1")
    assert other.starting("worker-1") is None and other.idle("worker-1") is None


def test_the_start_up_clock_runs_only_while_the_worker_holds_work_and_stops_at_its_first_commit():
    watch = HangWatch(HangBounds(timeout_s=2.0))
    run(watch, 0.0, 10.0, running=())  # no lease yet (building its model, waiting for the shards)
    assert watch.starting("worker-0") is None
    run(watch, 10.0, 5.0)
    assert watch.starting("worker-0") == pytest.approx(4.9)  # the first tick that sees it running counts nothing
    watch.committed("worker-0")
    assert watch.starting("worker-0") is None and watch.idle("worker-0") == 0.0
    assert [h.what for h in run(watch, 15.0, 3.0)] != []  # from then on, --hang-timeout's bound


def test_ps_a_leased_worker_that_never_commits_is_declared_hung_at_the_start_up_bound_not_at_the_timeout():
    coord = ps_job(timeout=2.0)
    lease = coord.ledger.leases["worker-0"]
    coord.hung_workers(0.0)
    other = coord.ledger.leases["worker-1"]
    assert coord.report_progress(InstanceId("worker", 1), other.task.task_id, other.start + 20, 1.0, False)
    late = ticks(coord, 0.0, 2.5)
    assert [h.worker for h in late] == ["worker-1"]  # committed once: --hang-timeout's bound
    coord.declare_hung(late[0], 2.5)
    assert ticks(coord, 2.5, STARTUP_FLOOR_S - 5) == []  # stuck on its first read: still within the start-up bound
    late = ticks(coord, STARTUP_FLOOR_S - 2.5, 5.0)
    assert [(h.worker, h.what, h.bound_s) for h in late] == [("worker-0", "first commit", STARTUP_FLOOR_S)]
    assert coord.declare_hung(late[0], STARTUP_FLOOR_S + 2.5) == (lease.start, lease.task.end)  # all of it
    event = [e for e in coord.timeline.events if e["kind"] == "hung"][-1]
    assert event["instance"] == "worker-0" and event["detail"].startswith("no first commit for")
