"""The step's Kubernetes Events on the real control plane: a killed worker, a worker Kueue preempted (with Kueue's own
reason) and the job's end are Events on the step's own pod, read back from the apiserver; repeated Events are one
Event with a series, many similar ones are combined (as client-go's recorder does), and a Role without the right to
them costs one warning, not the job."""

from __future__ import annotations

import logging

import pytest
from kubernetes import client
from kubernetes import config as kube_config

from elastic_step.backends.kubernetes import Owner
from elastic_step.backends.kubernetes.events import COMBINED, CONTROLLER, SIMILAR_MAX, EventRecorder
from elastic_step.master.api import TrainConfig
from tests.infra.kube.harness import wait_for
from tests.integration.harness import LEASES_OUTLAST_A_KILL
from tests.kubernetes.jobs import registrations, run_held, step_pod_env, tally_job
from tests.kubernetes.test_backend import (  # noqa: F401 - fixtures
    job_backend,
    priority_classes,
    run_job,
    sa_kubeconfig,
    sleeper_pod,
    step_account,
)
from tests.kubernetes.test_queues import (  # noqa: F401 - a fixture
    QUEUED,
    preempted,
    team_queue,
    urgent_pod,
    urgent_priority,
)
from tests.models.witness import assert_audit_exact, assert_exactly_once

pytestmark = pytest.mark.kubernetes


def events_on(api_client, namespace: str, pod: str) -> list:
    """The step's events.k8s.io Events regarding pod `pod`, as the apiserver holds them (not the scheduler's, nor
    Kueue's: their core/v1 Events have no eventTime, which the client's events.k8s.io model refuses)."""
    selector = f"regarding.name={pod},reportingController={CONTROLLER}"
    return client.EventsV1Api(api_client).list_namespaced_event(namespace, field_selector=selector).items


def test_a_killed_worker_and_the_jobs_end_are_events_on_the_steps_pod(
    control_plane, core, node, namespace, sa_kubeconfig, tally_data, tmp_path
):
    step = sleeper_pod(core, namespace, "step")  # the pod the step's master would run in
    rows = tally_data["rows"]
    params = tally_job("events", tally_data, tmp_path / "out", 4, max_workers=2, backend="kubernetes")
    cfg = TrainConfig(
        **{**params, **LEASES_OUTLAST_A_KILL, "output": str(params["output"]), "progress": "off"},
        chaos=(f"kill:worker-0@{rows}",),
    )
    backend = job_backend("events", sa_kubeconfig, namespace, step)  # the Role's rights only
    thread, _, result = run_job(cfg, backend)
    thread.join(600)
    assert not thread.is_alive() and "error" not in result, result.get("error")
    summary = result["summary"]
    assert_exactly_once(summary)
    assert summary["workers"]["lost_by_cause"] == {"killed": 1}, summary["workers"]
    events = events_on(control_plane.api_client(), namespace, "step")
    lost = [e for e in events if e.reason == "WorkerLost"]
    assert len(lost) == 1, [(e.reason, e.note) for e in events]
    assert lost[0].type == "Warning" and lost[0].action == "Relaunch"
    assert lost[0].note.startswith("worker-0 lost (killed): "), lost[0].note
    assert lost[0].regarding.uid == step.metadata.uid
    finished = [e for e in events if e.reason == "TrainingFinished"]
    assert len(finished) == 1 and finished[0].type == "Normal", [(e.reason, e.note) for e in events]
    assert f"{4 * rows} records committed" in finished[0].note and "goodput" in finished[0].note


def test_a_worker_kueue_preempts_is_an_event_on_the_steps_pod_with_kueues_reason(
    control_plane,
    kueue,
    core,
    node,
    kueue_namespace,
    tally_data,
    priority_classes,
    urgent_priority,
    sa_kubeconfig,
    tmp_path,
):
    """A quota of the core and two workers; a workload above the workers' priority takes one worker's quota: Kueue
    preempts one worker, and the step's pod carries a WorkerLost Event quoting the reason Kueue gave on its
    Workload."""
    job, namespace = "kueue-events", kueue_namespace
    step = sleeper_pod(core, namespace, "step")  # not Kueue's: it has no queue label
    cq = team_queue(kueue, namespace)

    def steps(master, log):
        wait_for(lambda: registrations(log) >= 2 or master.poll() is not None, 300, what="both workers")
        urgent_pod(core, namespace, "urgent", "team", "1", urgent_priority)
        wait_for(lambda: preempted(log) or master.poll() is not None, 240, what="a worker preempted by Kueue")

    summary, _, _ = run_held(
        sa_kubeconfig,
        namespace,
        tmp_path,
        tally_data,
        job,
        steps,
        diagnose=lambda: kueue.describe(namespace, (cq,)),
        env=step_pod_env(step),
        **{**QUEUED, "max_workers": 2},
        queue="team",
    )
    assert summary["workers"]["lost_by_cause"] == {"kueue": 1}, summary["workers"]
    assert_audit_exact(summary, "ps")
    # Kueue's own word on the preemption: its Event on the preempted worker's Workload
    urgent_uid = core.read_namespaced_pod("urgent", namespace).metadata.uid
    (taken,) = kueue.preempted_pods(namespace, urgent_uid)
    kueue_said = [
        e.message
        for e in core.list_namespaced_event(namespace, field_selector="reason=Preempted").items
        if e.involved_object.kind == "Workload" and e.involved_object.name.startswith(f"pod-{taken}-")
    ]
    assert len(kueue_said) == 1 and f"JobUID: {urgent_uid})" in kueue_said[0], kueue_said
    events = events_on(control_plane.api_client(), namespace, "step")
    lost = [e for e in events if e.reason == "WorkerLost"]
    assert len(lost) == 1, [(e.reason, e.note) for e in events]
    worker = taken.removeprefix(f"{job}-")
    assert lost[0].note.startswith(f"{worker} lost (kueue): "), lost[0].note
    assert f"preempted by Kueue (pod {taken}): {kueue_said[0]}" in lost[0].note, (lost[0].note, kueue_said)
    assert lost[0].type == "Warning" and lost[0].action == "Relaunch"
    assert lost[0].regarding.uid == step.metadata.uid


def test_repeated_events_are_one_event_with_a_series_and_many_similar_ones_are_combined(
    control_plane, core, node, namespace
):
    step = sleeper_pod(core, namespace, "step")
    api = control_plane.api_client()
    recorder = EventRecorder(client.EventsV1Api(api), namespace, Owner("step", step.metadata.uid), "step")
    for _ in range(3):
        recorder.record("WorkerHung", "worker-0: declared hung", "Fence", warning=True)
    for i in range(SIMILAR_MAX + 3):
        recorder.record("WorkerFenced", f"worker-{i}: launch 1 fenced", "Fence", warning=True)
    recorder.close()
    events = events_on(api, namespace, "step")
    hung = [e for e in events if e.reason == "WorkerHung"]
    assert len(hung) == 1 and hung[0].series is not None and hung[0].series.count == 3, hung
    fenced = [e for e in events if e.reason == "WorkerFenced"]
    assert len(fenced) == SIMILAR_MAX + 1, [e.note for e in fenced]
    combined = [e for e in fenced if e.note.startswith(COMBINED)]
    assert len(combined) == 1 and combined[0].series.count == 3, combined


def test_a_role_without_the_right_to_events_costs_a_warning_not_the_job(control_plane, core, node, namespace, caplog):
    step = sleeper_pod(core, namespace, "step")
    kubeconfig = step_account(control_plane, namespace, drop=("create", "events"))
    api = kube_config.new_client_from_config(str(kubeconfig))
    recorder = EventRecorder(client.EventsV1Api(api), namespace, Owner("step", step.metadata.uid), "step")
    with caplog.at_level(logging.WARNING, logger="elastic_step.backends.kubernetes"):
        recorder.record("WorkerLost", "worker-0 lost (killed)", "Relaunch", warning=True)
        recorder.record("WorkerLost", "worker-1 lost (killed)", "Relaunch", warning=True)
        recorder.close()
    refused = [r.getMessage() for r in caplog.records if "no Kubernetes Events about the step" in r.getMessage()]
    assert len(refused) == 1 and "may not create events.k8s.io events" in refused[0], caplog.text
    assert events_on(control_plane.api_client(), namespace, "step") == []
