"""A fleet of a few dozen light worker pods (tests/kubernetes/fleet.py) on the real control plane: a master that
dies and one restarted on its address adopt them all, every pod kept, none duplicated. bench/kube_fleet.py does the
same with hundreds, and measures."""

from __future__ import annotations

import pytest

from elastic_step.backends.api import EventKind, InstanceId
from tests.kubernetes.fleet import FleetMaster, PodRecorder

pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.process_pods(
        "light workers of the tests' own (no TensorFlow), dozens at once: the master's adoption at scale"
    ),
]

FLEET = 30
JOB = "fleet"
LABEL = "elastic-step-test/fleet"
TAINT = {"key": LABEL, "value": "yes", "effect": "NoSchedule"}
PLACEMENT = {"nodeSelector": {LABEL: "yes"}, "tolerations": [{**TAINT, "operator": "Equal"}]}


@pytest.fixture(scope="module")
def fleet_node(control_plane):
    """The fleet's own node: its pods do not crowd the other tests' node."""
    yield control_plane.add_node("fleet-1", cpu="4", memory="32Gi", pods=FLEET, labels={LABEL: "yes"}, taints=[TAINT])
    control_plane.remove_node("fleet-1")


def _pods(core, namespace: str) -> dict[str, str]:
    """The job's pods not being deleted: name -> uid."""
    items = core.list_namespaced_pod(namespace, label_selector=f"elastic-step/job={JOB}").items
    return {p.metadata.name: p.metadata.uid for p in items if not p.metadata.deletion_timestamp}


def test_a_restarted_master_adopts_every_pod_of_a_fleet_without_a_duplicate(control_plane, core, fleet_node, namespace):
    """Master 1 runs the fleet and dies. Master 2, on its address with the job's token, keeps every pod (the same
    uid, no pod created or deleted), and every worker goes on with it; never two live pods of one worker."""
    recorder = PodRecorder(core, namespace)
    first = FleetMaster(control_plane, namespace, JOB, "fleet-token", think_s=0.2, pod_spec=PLACEMENT)
    try:
        first.launch(FLEET)
        first.wait("every worker registered with master 1", lambda: first.registered() == FLEET, 180)
    except BaseException:
        first.close()
        raise
    before = _pods(core, namespace)
    assert len(before) == FLEET, sorted(before)
    first.crash()

    second = FleetMaster(control_plane, namespace, JOB, "fleet-token", 0.2, port=first.port, pod_spec=PLACEMENT)
    try:
        workers = [InstanceId("worker", i) for i in range(FLEET)]
        assert second.backend.token_reused
        assert second.backend.adopted == {w: f"{JOB}-worker-{w.index}" for w in workers}
        second.launch(FLEET)  # the same commands: each pod is kept
        second.wait("every worker running for master 2", lambda: len(second.seen(EventKind.RUNNING)) == FLEET, 60)
        started = second.seen(EventKind.STARTED)
        assert {w: started[w][1].detail for w in workers} == {w: f"adopted pod {JOB}-worker-{w.index}" for w in workers}
        second.wait("every worker registered with master 2", lambda: second.registered() == FLEET, 120)
        assert _pods(core, namespace) == before
        made, watch = second.requests.snapshot(), dict(second.backend.stats)
        assert made["create", "pods"] == made["delete", "pods"] == 0, made
    finally:
        second.close()
        recorder.stop()
    assert recorder.max_live == {(JOB, "worker", str(i)): 1 for i in range(FLEET)}
    assert _pods(core, namespace) == {}
    print(f"\n{FLEET} pods adopted by a restarted master; its API requests: {dict(made)}; its watch: {watch}")
