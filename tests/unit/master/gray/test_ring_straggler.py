"""allreduce straggler decisions (master/gray/ring_straggler.py): whom the ring leaves out, and when not."""

from __future__ import annotations

import time

from elastic_step.backends.api import InstanceId
from elastic_step.master.gray.ring_straggler import MIN_SAMPLES, SKIP, RingPaceWatch
from elastic_step.master.leases.coordinator import Coordinator
from elastic_step.master.leases.ledger import Ledger, ShardInfo
from elastic_step.master.leases.rendezvous import Ready

RING = ["worker-0", "worker-1", "worker-2"]


def _steps(watch: RingPaceWatch, step_s: dict[str, float], steps: int, records: int = 96) -> None:
    for _ in range(steps):
        watch.committed({w: (s, records) for w, s in step_s.items()})


def test_a_member_ten_times_slower_is_left_out_then_its_replacement_as_slow_for_good():
    watch = RingPaceWatch()
    _steps(watch, {"worker-0": 0.4, "worker-1": 0.04, "worker-2": 0.05}, SKIP + MIN_SAMPLES)
    s = watch.pick(RING, min_workers=1)
    assert (s.worker, s.step_s, s.others_step_s, s.members, s.again) == ("worker-0", 0.4, 0.045, 3, False)
    assert round(s.ratio, 1) == 8.9 and s.figures()["action"] == "left out of the ring, replaced"
    assert str(s).startswith("0.400 s a step against 0.045 s for the others (8.9x a record, a ring of 2")
    watch.forget("worker-0")  # released; its replacement measures afresh
    assert watch.pick(RING, 1) is None
    _steps(watch, {"worker-0": 0.4, "worker-1": 0.04, "worker-2": 0.05}, SKIP + MIN_SAMPLES)
    again = watch.pick(RING, 1)
    assert again.worker == "worker-0" and again.again and again.action == "left out of the ring for good"


def test_a_pace_is_per_record_so_a_member_at_its_leases_end_is_no_straggler_nor_hides_one():
    watch = RingPaceWatch()
    for _ in range(SKIP + MIN_SAMPLES):  # worker-0 trains 1 minibatch of the 3 the others do, in a third the time
        watch.committed({"worker-0": (0.02, 32), "worker-1": (0.06, 96), "worker-2": (0.05, 96)})
    assert watch.pick(RING, 1) is None
    _steps(watch, {"worker-0": 0.4, "worker-1": 0.04, "worker-2": 0.05}, MIN_SAMPLES)
    assert watch.pick(RING, 1).worker == "worker-0"


def test_no_false_alarm_first_steps_evaluation_few_samples_a_busy_machine_and_min_workers():
    slow = {"worker-0": 0.4, "worker-1": 0.04, "worker-2": 0.05}
    # A member's first steps (tracing for seconds) are no pace, nor are too few steps.
    watch = RingPaceWatch()
    watch.committed({"worker-0": (0.05, 96), "worker-1": (30.0, 96), "worker-2": (0.05, 96)})
    _steps(watch, {"worker-0": 0.05, "worker-1": 0.05, "worker-2": 0.05}, SKIP - 1 + MIN_SAMPLES)
    assert watch.pick(RING, 1) is None
    _steps(watch, slow, MIN_SAMPLES - 1)
    assert watch.pick(RING, 1) is None  # worker-0 is slow in 9 of its 20 steps: its median is not
    # Steps without records (no lease) or without a time (an older worker) give no sample.
    _steps(watch, slow, 20, records=0)
    watch.committed({"worker-0": (0.0, 96)})
    assert watch.pick(RING, 1) is None
    # Committed while the master evaluates: not counted.
    watch.quiet = True
    _steps(watch, slow, 20)
    assert watch.pick(RING, 1) is None
    # A machine busy enough to slow every member 10x alike makes no straggler.
    watch.quiet = False
    _steps(watch, {w: 10 * s for w, s in {"worker-0": 0.05, "worker-1": 0.04, "worker-2": 0.05}.items()}, 20)
    assert watch.pick(RING, 1) is None
    # 6x slower, but a step of so small a model that it costs the ring under MIN_COST_S a step (a healthy replacement
    # measured on a loaded machine).
    _steps(watch, {"worker-0": 0.013, "worker-1": 0.002, "worker-2": 0.002}, 20)
    assert watch.pick(RING, 1) is None
    # 3.5x slower is not FACTOR (4) times.
    _steps(watch, {"worker-0": 0.35, "worker-1": 0.1, "worker-2": 0.1}, 20)
    assert watch.pick(RING, 1) is None
    # Slow enough, but the ring left without it would be below min_workers.
    _steps(watch, slow, 20)
    assert watch.pick(RING, min_workers=3) is None
    assert watch.pick(RING, min_workers=2).worker == "worker-0"


def test_two_members_the_slower_leaves_when_one_at_full_pace_beats_two_at_its_pace():
    watch = RingPaceWatch()
    _steps(watch, {"worker-0": 0.05, "worker-1": 0.5}, SKIP + MIN_SAMPLES)
    assert watch.pick(["worker-0", "worker-1"], 1).worker == "worker-1"
    assert watch.pick(["worker-0"], 1) is None  # a ring of one has no one to compare


def _ring(min_workers: int = 1) -> Coordinator:
    # The ring starts with all three (min_workers 3), then keeps `min_workers`.
    coord = Coordinator(Ledger([ShardInfo("s", 100_000)], 1000, 1, 32), num_ps=0, min_workers=3, ring_max_workers=3)
    rdv = coord.rendezvous
    for i in range(len(RING)):
        coord.membership.launched(InstanceId("worker", i), relaunch=False)
        coord.register(InstanceId("worker", i), f"h:{i}")
    assert rdv.version == 1 and [n for n, _ in rdv.members] == RING
    coord.min_workers = min_workers
    return coord


def _commit_steps(coord: Coordinator, step_s: dict[str, float], steps: int) -> None:
    rdv = coord.rendezvous
    leases = {w: coord.ledger.lease(w, time.time()) for w in step_s}
    for _ in range(steps):
        step = rdv.committed_step + 1
        for w, s in step_s.items():
            lease = leases[w]
            mark = lease.watermark + 32 if lease.watermark + 32 <= lease.task.end else lease.watermark
            kind, _ = rdv.step_ready(w, rdv.version, step, Ready(lease.task.task_id, mark, 32, 0.5, 7, s))
        assert kind == "commit"
        leases = {w: coord.ledger.leases.get(w) or coord.ledger.lease(w, time.time()) for w in step_s}


def test_the_coordinator_leaves_a_straggler_out_of_the_ring_and_requeues_its_lease():
    coord = _ring()
    _commit_steps(coord, {"worker-0": 0.3, "worker-1": 0.03, "worker-2": 0.03}, SKIP + MIN_SAMPLES)
    assert coord.ring_straggler(paused=True) is None  # an epoch's evaluation
    coord.rendezvous.hold_commits = True  # a checkpoint's hold
    assert coord.ring_straggler() is None
    coord.rendezvous.hold_commits = False
    s = coord.ring_straggler()
    assert s.worker == "worker-0" and not s.again
    remainder = coord.declare_straggler(s, time.time())
    assert remainder is not None and "worker-0" not in coord.ledger.leases
    assert [n for n, _ in coord.rendezvous.members] == ["worker-1", "worker-2"]
    event = next(e for e in coord.timeline.events if e["kind"] == "straggler")
    assert event["instance"] == "worker-0" and event["action"] == "left out of the ring, replaced"
    assert event["step_s"] == 0.3 and event["others_step_s"] == 0.03 and event["ratio"] == 10.0
    assert any(e["kind"] == "requeued" and e["instance"] == "worker-0" for e in coord.timeline.events)
    assert coord.retired == set() and coord.ring_straggler() is None


def test_the_coordinator_keeps_min_workers_in_the_ring():
    coord = _ring(min_workers=3)
    _commit_steps(coord, {"worker-0": 0.3, "worker-1": 0.03, "worker-2": 0.03}, SKIP + MIN_SAMPLES)
    assert coord.ring_straggler() is None
