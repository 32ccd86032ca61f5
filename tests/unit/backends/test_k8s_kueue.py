"""The job's pods in a Kueue queue: their labels, why Kueue stopped one, and a missing queue (no cluster needed;
Kueue's real manager decides in tests/kubernetes/test_queues.py)."""

import types

import pytest

from elastic_step.backends.kubernetes.errors import KubernetesBackendError
from elastic_step.backends.kubernetes.kueue import check_local_queue, eviction_cause
from elastic_step.backends.kubernetes.pods import _deletion_cause
from elastic_step.errors import ConfigError
from tests.unit.backends.pods import job_pod


def body(role: str, queue: str) -> dict:
    return job_pod(role, index=1, number=2, spec={"cpu": "1"}, queue=queue, num_ps=3)


def test_each_worker_is_a_workload_and_the_parameter_servers_one_group():
    worker, ps = body("worker", "team-a"), body("ps", "team-a")
    assert worker["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert "kueue.x-k8s.io/pod-group-name" not in worker["metadata"]["labels"]
    assert "annotations" not in worker["metadata"]
    assert ps["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert ps["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "j-ps"  # a relaunched shard joins it too
    assert ps["metadata"]["annotations"] == {"kueue.x-k8s.io/pod-group-total-count": "3"}
    assert worker["metadata"]["labels"]["elastic-step/job"] == "j"  # the backend's own labels stay


def test_without_a_queue_no_kueue_label():
    for role in ("worker", "ps"):
        b = body(role, "")
        assert not any(k.startswith("kueue.x-k8s.io/") for k in b["metadata"]["labels"])
        assert "annotations" not in b["metadata"]


def pod(*conditions) -> dict:
    return {"metadata": {"name": "j-worker-2"}, "status": {"conditions": list(conditions)}}


def test_a_pod_stopped_by_kueue_says_so_and_why():
    preempted = {
        "type": "TerminationTarget",
        "status": "True",
        "reason": "WorkloadEvictedDueToPreempted",
        "message": "Preempted to accommodate a workload due to prioritization in the ClusterQueue",
    }
    assert eviction_cause(pod(preempted)) == (
        "preempted by Kueue (pod j-worker-2): Preempted to accommodate a workload due to prioritization in the "
        "ClusterQueue"
    )
    assert _deletion_cause(pod(preempted)).startswith("preempted by Kueue")
    timeout = {"type": "TerminationTarget", "status": "True", "reason": "WorkloadEvictedDueToPodsReadyTimeout"}
    assert eviction_cause(pod(timeout)) == "evicted (PodsReadyTimeout) by Kueue (pod j-worker-2)"
    assert eviction_cause(pod({"type": "Ready", "status": "True"})) is None
    assert _deletion_cause(pod()) == "pod j-worker-2 deleted from outside the master"


CUSTOM = types.SimpleNamespace(get_namespaced_custom_object=None)  # the call below never calls it


class _Refused:
    """The backend's API call, answering 404 as the apiserver words it (the custom objects API is not called)."""

    def __init__(self, message: str):
        self.message = message

    def __call__(self, verb, resource, fn, *args, **kwargs):
        raise KubernetesBackendError(f"{verb} {resource} in namespace ns failed (404 Not Found): {self.message}", 404)


def test_a_missing_local_queue_is_named_with_the_fix():
    with pytest.raises(ConfigError) as e:
        check_local_queue(CUSTOM, "ns", "team-x", _Refused('localqueues.kueue.x-k8s.io "team-x" not found'))
    assert "no Kueue LocalQueue 'team-x' in namespace ns" in str(e.value)
    assert "kubectl get localqueues -n ns" in str(e.value)


def test_a_cluster_without_kueue_is_named_with_the_fix():
    with pytest.raises(ConfigError) as e:
        check_local_queue(CUSTOM, "ns", "team-x", _Refused("the server could not find the requested resource"))
    assert "this cluster has no Kueue" in str(e.value) and "leave the queue empty" in str(e.value)


def test_other_refusals_pass_through():
    def forbidden(*args, **kwargs):
        raise KubernetesBackendError("get localqueues refused", 403)

    with pytest.raises(KubernetesBackendError):
        check_local_queue(CUSTOM, "ns", "team-x", forbidden)
