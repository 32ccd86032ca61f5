"""Kueue's real manager in the harness (tests.infra.kube.harness.kueue): quota gates plain pods, raising it admits
them, namespaces that did not opt in are left alone, and a higher priority preempts."""

from __future__ import annotations

import pytest
from kubernetes import client, watch

from tests.infra.kube.harness import wait_for
from tests.infra.kube.harness.kueue import ADMISSION_GATE, PRIORITY_LABEL, QUEUE_LABEL
from tests.kubernetes.pod_security import restricted

pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.process_pods("Kueue's admission of plain pods: none runs the project's image"),
]


def pod(name: str, *, queue: str | None = "q", cpu: str = "1", priority: str | None = None) -> dict:
    labels = {QUEUE_LABEL: queue} if queue else {}
    if priority:
        labels[PRIORITY_LABEL] = priority
    return restricted(
        {
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {
                        "name": "main",
                        "image": "none",
                        "command": ["sleep", "600"],
                        "resources": {"requests": {"cpu": cpu}},
                    }
                ],
            },
        }
    )


def gated(p: client.V1Pod) -> bool:
    return any(g.name == ADMISSION_GATE for g in p.spec.scheduling_gates or [])


def phases(core, ns) -> dict[str, tuple[str, bool]]:
    return {p.metadata.name: (p.status.phase, gated(p)) for p in core.list_namespaced_pod(ns).items}


@pytest.fixture
def queue(kueue, kueue_namespace):
    """ClusterQueue (cpu 2, lower priorities preempted within it) and LocalQueue ``q``, both for this test."""
    kueue.resource_flavor(kueue_namespace)
    kueue.cluster_queue(
        kueue_namespace,
        {"cpu": "2"},
        flavor=kueue_namespace,
        preemption={"withinClusterQueue": "LowerPriority"},
    )
    kueue.local_queue(kueue_namespace, "q", kueue_namespace)
    return kueue_namespace  # kueue_namespace deletes the ClusterQueue and the flavor after the test


def test_quota_admits_two_of_three_and_more_when_raised(kueue, core, node, queue):
    ns = queue
    for i in range(3):
        created = core.create_namespaced_pod(ns, pod(f"p{i}"))
        gates = [g.name for g in created.spec.scheduling_gates or []]
        assert gates == [ADMISSION_GATE], f"{created.metadata.name}: {gates} (the topology gate is off)"
    wait_for(
        lambda: sorted(s for s, _ in phases(core, ns).values()).count("Running") == 2,
        30,
        what="two of three pods running",
    )
    wait_for(lambda: len(kueue.workloads(ns)) == 3, 10, what="three workloads")
    states = kueue.workloads(ns)
    assert sorted(w.state for w in states) == ["admitted", "admitted", "pending"], states
    waiting = next(w for w in states if w.state == "pending")
    assert "insufficient" in waiting.message.lower(), waiting
    assert phases(core, ns)[waiting.pod] == ("Pending", True)

    kueue.set_quota(ns, "cpu", "3")
    wait_for(lambda: phases(core, ns)[waiting.pod] == ("Running", False), 30, what=f"{waiting.pod} admitted and run")
    assert [w.state for w in kueue.workloads(ns)] == ["admitted"] * 3


def test_namespace_not_opted_in_is_left_alone(kueue, core, node, namespace):
    created = core.create_namespaced_pod(namespace, pod("free"))
    assert not created.spec.scheduling_gates and not created.metadata.finalizers
    wait_for(lambda: phases(core, namespace).get("free") == ("Running", False), 30, what="the pod running")
    assert kueue.workloads(namespace) == []


def test_higher_priority_preempts_a_lower_one(kueue, core, node, queue):
    ns = queue
    kueue.workload_priority_class(f"{ns}-low", 100)
    kueue.workload_priority_class(f"{ns}-high", 1000)
    for i in range(2):
        core.create_namespaced_pod(ns, pod(f"low{i}", priority=f"{ns}-low"))
    wait_for(lambda: [s for s, _ in phases(core, ns).values()] == ["Running"] * 2, 30, what="both low pods running")
    since = core.list_namespaced_pod(ns).metadata.resource_version
    core.create_namespaced_pod(ns, pod("high", priority=f"{ns}-high"))

    # the victim as it went away: Kueue marks it TerminationTarget, then deletes it
    victim = None
    w = watch.Watch()
    for ev in w.stream(core.list_namespaced_pod, ns, resource_version=since, timeout_seconds=30):
        p = ev["object"]
        if ev["type"] == "DELETED" and p.metadata.name.startswith("low"):
            victim = p
            w.stop()
    assert victim is not None, f"no low pod deleted: {phases(core, ns)}"
    cond = next((c for c in victim.status.conditions or [] if c.type == "TerminationTarget"), None)
    assert cond is not None and cond.status == "True", victim.status.conditions
    assert cond.reason == "WorkloadEvictedDueToPreempted", cond
    wait_for(lambda: phases(core, ns).get("high") == ("Running", False), 30, what="the high pod admitted and run")
    survivors = {n for n in phases(core, ns) if n.startswith("low")}
    assert survivors == {"low0", "low1"} - {victim.metadata.name}
