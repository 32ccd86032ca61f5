"""A pod that waits is reported with what holds it, in Kueue's or the scheduler's words (no cluster needed; Kueue's
real manager holds the pods in tests/kubernetes/test_queues.py)."""

from elastic_step.backends.kubernetes.pending import due, queue_reason, schedule_reason, what_holds

GATE = {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]}


def pod(spec=None, conditions=()) -> dict:
    return {
        "metadata": {"name": "j-worker-2-2", "uid": "u-2", "labels": {"kueue.x-k8s.io/queue-name": "team"}},
        "spec": dict(spec or {}),
        "status": {"phase": "Pending", "conditions": list(conditions)},
    }


def workload(owner_uid: str, *conditions) -> dict:
    return {
        "metadata": {"name": "pod-j-worker-2-2-1a2b3", "ownerReferences": [{"kind": "Pod", "uid": owner_uid}]},
        "status": {"conditions": list(conditions)},
    }


QUOTA = {
    "type": "QuotaReserved",
    "status": "False",
    "reason": "Pending",
    "message": "couldn't assign flavors to pod set main: insufficient unused quota for cpu in flavor f, 1 more needed",
}


def test_a_gated_pod_is_explained_by_its_own_workloads_condition():
    other = workload("u-9", {"type": "Admitted", "status": "True"})
    why = queue_reason(pod(GATE), [other, workload("u-2", QUOTA)])
    assert why == (
        "held by Kueue's admission gate in queue 'team': Workload pod-j-worker-2-2-1a2b3 not admitted (Pending): "
        + QUOTA["message"]
    )


def test_a_gated_pod_whose_workload_is_admitted_or_missing_or_unreadable():
    admitted = workload("u-2", {"type": "QuotaReserved", "status": "True"}, {"type": "Admitted", "status": "True"})
    assert queue_reason(pod(GATE), [admitted]).endswith("is admitted, and the gate is not yet lifted")
    assert queue_reason(pod(GATE), []).endswith("Kueue has made no Workload for it yet")
    assert "give the step's Role list on workloads.kueue.x-k8s.io" in queue_reason(pod(GATE), None)


def test_an_ungated_pod_is_explained_by_the_scheduler():
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}
    assert schedule_reason(pod(conditions=[unschedulable])) == "not scheduled (Unschedulable): 0/3 nodes"
    assert schedule_reason(pod({"nodeName": "n1"})) == "on node n1, not running yet"
    # Only a gated pod asks for the Workloads.
    assert what_holds(pod(conditions=[unschedulable]), lambda: 1 / 0).startswith("not scheduled")


def test_a_pod_is_reported_once_per_bound_it_waits():
    assert not due(299, 0, 300) and due(300, 0, 300) and not due(599, 1, 300) and due(600, 1, 300)
    assert not due(10_000, 0, 0)  # 0: never
