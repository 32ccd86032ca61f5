from elastic_step.master.failures import FailureReports
from elastic_step.master.timeline import Timeline


def test_the_first_failure_is_the_jobs_and_ends_it_once_while_internal_ones_wait_for_their_instance():
    ended = []
    timeline = Timeline()
    failures = FailureReports(timeline, job_failed=lambda: ended.append(True))
    failures.report("worker-0", "internal", "disk gone", "tb")
    assert failures.failure is None and ended == []
    failures.report("worker-1", "data_error", "bad row", "tb", minibatch="records [0, 8) of s0")
    failures.report("master", "terminated", "the master received SIGTERM", "")
    assert failures.failure["instance"] == "worker-1" and ended == [True]
    assert failures.take("worker-0")["message"] == "disk gone" and failures.take("worker-0") is None
    assert [e["detail"] for e in timeline.events] == [
        "internal: disk gone",
        "data_error on records [0, 8) of s0: bad row",
        "terminated: the master received SIGTERM",
    ]
