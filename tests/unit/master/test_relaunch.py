"""The relaunch policy: a lost worker is relaunched, a deterministic error is not relaunched into a loop."""

from __future__ import annotations

from elastic_step.backends.api import EventKind, InstanceEvent, InstanceId
from elastic_step.master.relaunch import RelaunchPolicy

W0, W1 = InstanceId("worker", 0), InstanceId("worker", 1)
ON = "records [64, 96) of part-00001.parquet in epoch 1"
ERROR = "ArrowInvalid: Parquet magic bytes not found in footer"


def crashed(inst: InstanceId) -> InstanceEvent:
    return InstanceEvent(EventKind.EXITED, inst, exit_code=1)


def report(message: str = ERROR, minibatch: str = ON) -> dict:
    return {"kind": "internal", "message": message, "traceback": f"Traceback ...\n{message}\n", "minibatch": minibatch}


def test_the_same_error_from_two_instances_on_the_same_minibatch_is_final_with_that_error():
    policy = RelaunchPolicy(max_relaunches=20)
    first = policy.on_end(crashed(W0), False, False, report=report())
    assert first.action == "relaunch", first  # once may be the instance's: a bad disk, a lost connection
    second = policy.on_end(crashed(W1), False, False, report=report())
    assert second.action == "fail", second
    assert "worker-0 and then worker-1 failed with the same error on " + ON in second.reason, second.reason
    assert second.reason.endswith("The error: " + ERROR), second.reason
    assert policy.relaunches == 1


def test_a_relaunched_instance_that_fails_again_the_same_way_counts_as_a_second_instance():
    policy = RelaunchPolicy(max_relaunches=20)
    assert policy.on_end(crashed(W0), False, False, report=report()).action == "relaunch"
    assert policy.on_end(crashed(W0), False, False, report=report()).action == "fail"


def test_another_error_or_another_minibatch_is_relaunched():
    policy = RelaunchPolicy(max_relaunches=20)
    assert policy.on_end(crashed(W0), False, False, report=report()).action == "relaunch"
    assert policy.on_end(crashed(W1), False, False, report=report("OSError: connection reset")).action == "relaunch"
    other = report(minibatch="records [96, 128) of part-00001.parquet in epoch 1")
    assert policy.on_end(crashed(W1), False, False, report=other).action == "relaunch"
    # Without a minibatch (failed while starting, say) the crash-loop rule and the budget decide.
    assert policy.on_end(crashed(W1), False, False, report=report(minibatch="")).action == "relaunch"
    assert policy.on_end(crashed(W1), False, False, report=report(minibatch="")).action == "relaunch"
    assert policy.relaunches == 5


def test_a_lost_worker_is_relaunched_and_a_users_error_fails_at_once():
    policy = RelaunchPolicy(max_relaunches=1)
    lost = InstanceEvent(EventKind.LOST, W0, exit_code=-9, detail="killed by SIGKILL")
    assert policy.on_end(lost, False, False).action == "relaunch"
    assert policy.on_end(lost, False, False).action == "fail"  # over the budget
    assert policy.on_end(crashed(W1), False, True).action == "fail"  # reported the user's error
    assert policy.on_end(crashed(W1), True, False).action == "none"  # training was over


def test_a_worker_left_out_for_good_is_not_relaunched_and_costs_no_relaunch():
    policy = RelaunchPolicy(max_relaunches=20)
    policy.retire(W0, "left out of the ring for good as a straggler")
    lost = InstanceEvent(EventKind.LOST, W0, detail="left out as a straggler, then exit code -9")
    decision = policy.on_end(lost, False, False)
    assert decision.action == "retire" and "worker-0 is not relaunched: left out" in decision.reason, decision
    assert policy.relaunches == 0
    assert policy.on_end(lost, False, False).action == "relaunch"  # once: a later launch of it is its own
