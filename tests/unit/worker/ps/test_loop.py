"""The worker loop's pure parts: minibatch boundaries, report coalescing and pacing."""

from __future__ import annotations

import threading
import types

from elastic_step.proto import elastic_pb2 as pb
from elastic_step.worker.ps.loop import Reporter, coalesce, minibatches


def task(start, end, task_start=0):
    return types.SimpleNamespace(start=start, end=end, task_start=task_start)


def test_minibatches_cover_the_lease_exactly():
    assert minibatches(task(0, 150), 64) == [(0, 64), (64, 128), (128, 150)]
    assert minibatches(task(5, 5), 64) == []


def test_a_remainder_pushes_the_same_keys_as_the_lost_worker():
    full = minibatches(task(512, 1024, task_start=512), 64)
    # The lost worker's watermark was 640, a minibatch end: the remainder re-pushes the same keys.
    remainder = minibatches(task(640, 1024, task_start=512), 64)
    assert remainder == [b for b in full if b[0] >= 640]
    # Wherever a remainder starts, its boundaries snap back to the task's grid after the first.
    odd = minibatches(task(600, 1024, task_start=512), 64)
    assert odd[0] == (600, 640) and odd[1:] == [b for b in full if b[0] >= 640]


def test_coalesce_merges_a_task_but_keeps_duplicates_apart():
    items = [(1, 64, 64, 1.0, False), (1, 128, 64, 3.0, False), (1, 192, 64, 2.0, True), (2, 64, 64, 1.0, False)]
    out = coalesce(items)
    assert out[0] == (1, 128, 128, 2.0, False)
    assert out[1] == (1, 192, 64, 2.0, True)
    assert out[2] == (2, 64, 64, 1.0, False)


class RecordingMaster:
    """Stands in for MasterClient.report only: what the reporter sends, in order."""

    def __init__(self):
        self.sent: list[tuple] = []
        self.lock = threading.Lock()

    def report(self, *item) -> pb.ProgressResponse:
        with self.lock:
            self.sent.append(item)
        return pb.ProgressResponse()


def test_reports_are_paced_and_a_flush_delivers_everything():
    master = RecordingMaster()
    reporter = Reporter(master, interval_s=60.0)
    try:
        for i in range(20):  # one task's minibatches, far faster than the report interval
            reporter.report(7, 64 * (i + 1), 64, 1.0, duplicate=False)
        reporter.flush()
    finally:
        reporter.close()
    assert len(master.sent) == 2  # the first at once, the rest at the flush
    assert master.sent[-1][:2] == (7, 64 * 20)  # the last watermark arrived
    assert sum(item[2] for item in master.sent) == 64 * 20  # every record counted, once


def test_a_leases_last_report_goes_without_waiting_for_the_pace():
    # The master moves a worker on to the lease it took ahead only once that report is in.
    master = RecordingMaster()
    reporter = Reporter(master, interval_s=60.0)
    try:
        reporter.report(7, 64, 64, 1.0, duplicate=False)  # the first goes at once
        reporter.in_flight.result()
        reporter.report(7, 128, 64, 1.0, duplicate=False)  # this one waits for the pace
        assert [item[:2] for item in master.sent] == [(7, 64)]
        reporter.report(7, 192, 64, 1.0, duplicate=False, last=True)
        reporter.in_flight.result()
        assert master.sent[-1][:3] == (7, 192, 128)  # coalesced with the one that waited
        reporter.report(8, 64, 64, 1.0, duplicate=False)  # the next lease: paced again
        assert len(master.sent) == 2 and reporter.pending
    finally:
        reporter.close()


def test_a_lease_ahead_is_asked_for_once_the_master_has_the_last_report_of_the_lease_before():
    # The master hands out no lease ahead until it has the last report of the lease before: the request waits
    # for that answer instead of polling.
    master = RecordingMaster()
    reporter = Reporter(master, interval_s=60.0)
    leaving = threading.Event()
    try:
        reporter.report(7, 64, 64, 1.0, duplicate=False)
        reporter.in_flight.result()
        assert not reporter.wait_finished(7, leaving, timeout_s=0.05)  # task 7's last report is not sent yet
        reporter.report(7, 128, 64, 1.0, duplicate=True, last=True)  # last, a duplicate: sent on its own
        reporter.in_flight.result()
        assert reporter.wait_finished(7, leaving, timeout_s=5.0)
        leaving.set()  # the worker left the lease: the request stops waiting
        assert not reporter.wait_finished(8, leaving, timeout_s=60.0)
    finally:
        reporter.close()


def test_a_refused_last_report_does_not_count_as_answered():
    class Refusing(RecordingMaster):
        def report(self, *item):
            super().report(*item)
            return pb.ProgressResponse(stop=True)

    reporter = Reporter(Refusing(), interval_s=60.0)
    try:
        reporter.report(7, 64, 64, 1.0, duplicate=False, last=True)
        reporter.in_flight.result()
        assert not reporter.wait_finished(7, threading.Event(), timeout_s=0.05)
    finally:
        reporter.close()
