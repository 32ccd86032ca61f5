"""Straggler decisions (master/gray/straggler.py): whose work an idle worker takes, and where a tail is cut."""

from __future__ import annotations

from elastic_step.master.gray.straggler import RESEARCH_S, StragglerWatch
from elastic_step.master.leases.ledger import Ledger, ShardInfo


def _paced(watch: StragglerWatch, worker: str, records_per_s: float, reports: int = 5, task_id: int = 999) -> None:
    for n in range(reports):
        watch.reported(worker, task_id, 10, n * 10 / records_per_s)


def _ledger() -> tuple[Ledger, object]:
    ledger = Ledger([ShardInfo("a", 200)], records_per_task=200, epochs=1, minibatch_size=5)
    return ledger, ledger.lease("slow", 0.0)


def test_an_idle_worker_takes_the_tail_of_a_much_slower_workers_lease_cut_where_both_finish_together():
    watch = StragglerWatch()
    _paced(watch, "slow", 10.0)
    _paced(watch, "fast", 90.0)
    ledger, lease = _ledger()
    ledger.report("slow", lease.task.task_id, 100)
    h = watch.pick("fast", ledger, 1.0)
    # 100 records left: the straggler keeps 10 (10 / (10 + 90) of them), the idle worker takes [110, 200).
    assert (h.holder, h.to, h.task_id, h.cut, h.records) == ("slow", "fast", lease.task.task_id, 110, 90)
    assert h.holder_s == 10.0 and h.figures()["idle_records_per_s"] == 90.0
    assert "straggler" not in str(h) and "re-leased to fast" in str(h)


def test_its_lease_ahead_goes_first_and_whole():
    watch = StragglerWatch()
    _paced(watch, "slow", 10.0)
    _paced(watch, "fast", 90.0)
    ledger = Ledger([ShardInfo("a", 200)], records_per_task=100, epochs=1, minibatch_size=5)
    current = ledger.lease("slow", 0.0)
    ahead = ledger.lease("slow", 0.0, after=current.task.task_id)
    h = watch.pick("fast", ledger, 1.0)
    assert (h.cut, h.task_id, h.records, h.holder_s) == (None, ahead.task.task_id, 100, 20.0)


def test_no_handover_between_workers_of_a_like_pace_for_a_short_tail_or_before_paces_are_known():
    ledger, _ = _ledger()
    watch = StragglerWatch()
    _paced(watch, "fast", 90.0)
    assert watch.pick("fast", ledger, 1.0) is None  # the holder's pace is not known yet
    _paced(watch, "slow", 30.0)  # 3x slower: a busy node, not a straggler
    assert watch.pick("fast", ledger, 2.0) is None
    watch = StragglerWatch()
    _paced(watch, "fast", 9000.0)
    _paced(watch, "slow", 1000.0)  # 9x slower, but 200 records at 1000/s: under MIN_TAIL_S
    assert watch.pick("fast", ledger, 1.0) is None
    watch = StragglerWatch()
    _paced(watch, "slow", 10.0)
    _paced(watch, "fast", 90.0, reports=2)  # one sample: not a pace yet
    assert watch.pick("fast", ledger, 1.0) is None


def test_a_search_that_found_nothing_is_not_made_again_at_once():
    ledger, _ = _ledger()
    watch = StragglerWatch()
    _paced(watch, "fast", 90.0)
    assert watch.pick("fast", ledger, 1.0) is None  # nothing: the holder's pace is not known yet
    _paced(watch, "slow", 10.0)
    assert watch.pick("fast", ledger, 1.1) is None  # every idle worker asks every 50 ms: not searched again yet
    assert watch.pick("fast", ledger, 1.0 + RESEARCH_S).holder == "slow"


def test_a_pace_is_a_median_of_reports_within_one_lease_so_a_pause_or_a_wait_for_work_is_no_pace():
    watch = StragglerWatch()
    watch.reported("w", 1, 10, 0.0)  # the first report of a lease: no sample
    for t in (1.0, 2.0, 3.0, 4.0):
        watch.reported("w", 1, 10, t)
    watch.reported("w", 1, 10, 34.0)  # a checkpoint's barrier between two reports
    watch.reported("w", 2, 10, 100.0)  # another lease after a wait for work: no sample
    assert watch.pace("w") == 10.0
    watch.forget("w")
    assert watch.pace("w") is None
