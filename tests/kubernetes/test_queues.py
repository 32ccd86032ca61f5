"""The job through Kueue's queues, on the real control plane, with Kueue's real manager deciding: every admission,
wait, preemption and reclaim below is Kueue's, read back from its own Workload objects, not from our code. The master
(the real CLI, with the shipped Role's rights only) gives its pods a LocalQueue (`queue`): each worker a workload of
its own, the parameter servers one group. It trains with the workers Kueue admits, treats an eviction as a loss
(the lease requeued, the replacement waiting in the queue) and takes back workers as Kueue admits them again.
Every record is still applied exactly once, by the tally weights and the audit.

Each job is held (tests/kubernetes/jobs.py run_held: paced, so it cannot end before the test's last step); every
step waits on a state of the cluster or of the master's log, never on time."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
from kubernetes import client

from tests.infra.kube.harness import wait_for
from tests.kubernetes.jobs import EPOCHS_HELD, registrations, run_held, tally_job, train
from tests.kubernetes.pod_security import restricted
from tests.kubernetes.test_backend import job_pods, priority_classes, sa_kubeconfig, secret_exists  # noqa: F401
from tests.models.witness import assert_audit_exact, assert_each_record_applied_exactly

WORKER = {"cpu": "1", "memory": "1Gi"}  # each worker pod's requests (= limits)
PS_CPU = "500m"  # the PS pod's: the core holds quota too, so a workload above its priority can take it
QUEUED = {"max_workers": 4, "worker_memory": WORKER["memory"], "ps_cpu": PS_CPU}


def worker_workloads(kueue, namespace: str, job: str) -> dict[str, str]:
    """{worker pod: admitted | pending | evicted | finished} of the job's worker workloads, by Kueue's own record."""
    return {w.pod: w.state for w in kueue.workloads(namespace) if (w.pod or "").startswith(f"{job}-worker-")}


def gated(pod: client.V1Pod) -> bool:
    return any(g.name == "kueue.x-k8s.io/admission" for g in pod.spec.scheduling_gates or [])


def running_workers(core, namespace: str, job: str) -> list[str]:
    return sorted(
        p.metadata.name
        for p in job_pods(core, namespace, job)
        if p.metadata.labels.get("elastic-step/role") == "worker"
        and p.status.phase == "Running"
        and not p.metadata.deletion_timestamp
    )


def preempted(log: Path) -> set[str]:
    """The workers the master logged as preempted by Kueue (its relaunch decision names the cause)."""
    return set(re.findall(r"(worker-\d+) preempted by Kueue", log.read_text()))


def preempted_for(log: Path, preemptor_pod_uid: str) -> list[str]:
    """The pods the master logged as preempted by Kueue for the workload of pod ``preemptor_pod_uid`` (the master's
    log quotes Kueue's reason, which names the preemptor's JobUID)."""
    pattern = r"preempted by Kueue \(pod ([\w-]+)\): Preempted to accommodate a workload \(UID: [\w-]+, JobUID: "
    return sorted(set(re.findall(pattern + re.escape(preemptor_pod_uid) + r"\)", log.read_text())))


def urgent_pod(core, namespace: str, name: str, queue: str, cpu: str, priority_class: str) -> None:
    """Another team's workload in a queue: a plain pod Kueue admits (or not) by its quota and priority."""
    core.create_namespaced_pod(
        namespace,
        restricted(
            {
                "metadata": {"name": name, "labels": {"kueue.x-k8s.io/queue-name": queue}},
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 1,
                    "priorityClassName": priority_class,
                    "containers": [
                        {
                            "name": "main",
                            "image": "busybox",
                            "command": ["sleep", "3600"],
                            "resources": {
                                "requests": {"cpu": cpu, "memory": "1Gi"},
                                "limits": {"cpu": cpu, "memory": "1Gi"},
                            },
                        }
                    ],
                },
            }
        ),
    )


@contextlib.contextmanager
def priority_class(control_plane, name: str, value: int):
    """Another team's PriorityClass, for this test only: it leaves nothing cluster-wide behind for the next test."""
    api = client.SchedulingV1Api(control_plane.api_client())
    with contextlib.suppress(client.ApiException):  # left by a test that was killed
        api.delete_priority_class(name)
    api.create_priority_class({"metadata": {"name": name}, "value": value, "preemptionPolicy": "Never"})
    try:
        yield name
    finally:
        with contextlib.suppress(client.ApiException):
            api.delete_priority_class(name)


@pytest.fixture
def urgent_priority(control_plane):
    """Above the workers' elastic-low, below the core's elastic-high."""
    with priority_class(control_plane, "team-urgent", 100) as name:
        yield name


@pytest.fixture
def critical_priority(control_plane):
    """Above the core's elastic-high."""
    with priority_class(control_plane, "team-critical", 5000) as name:
        yield name


def team_queue(kueue, namespace: str) -> str:
    """LocalQueue `team` in `namespace`, on a ClusterQueue of its own with room for the core (the PS: PS_CPU) and
    two workers, where a workload preempts those of a lower priority; returns the ClusterQueue's name."""
    cq = f"{namespace}-cq"
    kueue.resource_flavor(namespace)
    quotas = {"cpu": "2500m", "memory": "16Gi"}
    kueue.cluster_queue(cq, quotas, flavor=namespace, preemption={"withinClusterQueue": "LowerPriority"})
    kueue.local_queue(namespace, "team", cq)
    return cq


def kueue_losses(summary: dict) -> list[dict]:
    return [e for e in summary["events"] if e["kind"] == "lost" and "by Kueue" in e["detail"]]


def test_the_quota_admits_workers_one_by_one_and_priority_preempts_workers_not_the_core(
    control_plane,
    kueue,
    core,
    node,
    kueue_namespace,
    tally_data,
    priority_classes,
    urgent_priority,
    critical_priority,
    sa_kubeconfig,
    tmp_path,
):
    """A quota of 2 workers' cpu, max_workers 4: exactly 2 train and 2 wait as pending workloads; raising the quota
    admits them and they join. Then a higher-priority workload takes 2 workers' quota: Kueue preempts 2 workers
    (never the PS, whose priority is the core's), the job trains on with 2, and once that workload ends Kueue admits
    the workers' replacements. Last, a workload above the core's own priority takes the whole quota: Kueue preempts
    the PS group too; once it ends, the job resumes from its last checkpoint."""
    job, namespace = "quota", kueue_namespace
    cq = team_queue(kueue, namespace)

    urgent_took = []  # the workers Kueue preempted for the urgent workload, before the critical one arrived
    first_waiting = []  # the worker pods Kueue kept waiting for quota at first
    kueue_took = []  # the pods Kueue's Events say it preempted for the urgent workload

    def steps(master, log):
        # Kueue admits two workers and keeps two waiting: their workloads pending, their pods gated.
        wait_for(
            lambda: (
                (
                    sorted(worker_workloads(kueue, namespace, job).values()).count("pending") == 2
                    and registrations(log) >= 2
                )
                or master.poll() is not None
            ),
            300,
            what="two workers admitted and two pending",
        )
        states = worker_workloads(kueue, namespace, job)
        assert sorted(states.values()) == ["admitted", "admitted", "pending", "pending"], states
        waiting = sorted(p for p, s in states.items() if s == "pending")
        first_waiting.extend(waiting)
        assert all(gated(core.read_namespaced_pod(p, namespace)) for p in waiting), waiting
        assert len(running_workers(core, namespace, job)) == 2
        # Past `pending_report`, the master says which workers wait and why, in Kueue's own words.
        wait_for(
            lambda: all(
                f"pod {w.pod} pending for" in log.read_text()
                and f"Workload {w.name} not admitted ({w.reason}): {w.message}" in log.read_text()
                for w in kueue.workloads(namespace)
                if w.pod in waiting
            ),
            60,
            what="each waiting worker reported with its Workload's condition",
        )
        # More quota: Kueue admits the two waiting workers, and they join the job.
        kueue.set_quota(cq, "cpu", "4500m")
        wait_for(lambda: registrations(log) >= 4 or master.poll() is not None, 240, what="all four workers")
        assert sorted(worker_workloads(kueue, namespace, job).values()) == ["admitted"] * 4
        # Another workload, of a higher priority than the workers', in the same ClusterQueue: Kueue preempts two.
        urgent_pod(core, namespace, "urgent", "team", "2", urgent_priority)
        wait_for(
            lambda: len(preempted(log)) >= 2 or master.poll() is not None,
            240,
            what="two workers preempted by Kueue",
        )
        wait_for(lambda: core.read_namespaced_pod("urgent", namespace).status.phase == "Running", 120, what="urgent")
        assert len(running_workers(core, namespace, job)) <= 2
        # As many workers as Kueue says it preempted for that workload (its Events), no more, no fewer: the two it
        # needed, and any replacement it admitted meanwhile and took back.
        urgent_uid = core.read_namespaced_pod("urgent", namespace).metadata.uid
        took = wait_for(
            lambda: (pods := kueue.preempted_pods(namespace, urgent_uid)) == preempted_for(log, urgent_uid) and pods,
            60,
            what="the master's preemptions to agree with Kueue's Events",
        )
        assert len(took) >= 2, took
        kueue_took.extend(took)
        before = registrations(log)
        # That workload ends: Kueue admits the replacements, which join.
        core.delete_namespaced_pod("urgent", namespace, grace_period_seconds=0)
        wait_for(lambda: registrations(log) >= before + 2 or master.poll() is not None, 240, what="replacements")
        # A workload above even the core's priority takes the whole quota: Kueue preempts the PS group too, and the
        # job waits. Once it ends, Kueue admits the core and the workers again, and the job resumes from its last
        # checkpoint (every shard restored).
        wait_for(lambda: "checkpoint 2 written" in log.read_text() or master.poll() is not None, 240, what="a cut")
        urgent_took.extend(re.findall(r"(worker-\d+) preempted by Kueue", log.read_text()))
        urgent_pod(core, namespace, "critical", "team", "4500m", critical_priority)
        wait_for(
            lambda: (
                "parameter server ps-0 was lost (preempted by Kueue" in log.read_text() or master.poll() is not None
            ),
            240,
            what="core",
        )
        wait_for(lambda: core.read_namespaced_pod("critical", namespace).status.phase == "Running", 120, what="it")
        core.delete_namespaced_pod("critical", namespace, grace_period_seconds=0)
        # Kueue admits the core's group again: its relaunched PS registers, to be restored from the checkpoint.
        wait_for(
            lambda: log.read_text().count("ps-0 registered") >= 2 or master.poll() is not None,
            240,
            what="the core admitted again",
        )

    summary, text, out = run_held(
        sa_kubeconfig,
        namespace,
        tmp_path,
        tally_data,
        job,
        steps,
        diagnose=lambda: kueue.describe(namespace, (cq,)),
        **QUEUED,
        queue="team",
        checkpoint_every=str(tally_data["rows"] * 2),
        pending_report="5",
    )
    # The waits are in summary.json too, each naming its pod and what held it.
    waits = [e["detail"] for e in summary["events"] if e["kind"] == "waiting"]
    for pod in first_waiting:
        assert any(d.startswith(f"pod {pod} pending for") and "admission gate in queue 'team'" in d for d in waits)
    losses = kueue_losses(summary)
    assert all("preempted by Kueue" in e["detail"] for e in losses), losses
    # The urgent workload took two workers and no PS: the core went only to the workload above its own priority
    # (which takes the workers too, in an order of Kueue's choosing).
    assert len(urgent_took) == len(kueue_took), (urgent_took, kueue_took)  # one loss per preemption Kueue made
    assert [e["instance"] for e in losses[: len(urgent_took)]] == urgent_took, losses
    (critical,) = [i for i, e in enumerate(losses) if e["instance"] == "ps-0"]
    assert critical >= 2 and all(e["instance"].startswith("worker-") for e in losses[:critical]), losses
    assert "due to prioritization in the ClusterQueue" in losses[0]["detail"], losses  # Kueue's own words
    (restore,) = summary["checkpoints"]["ps_restores"]
    assert restore["ps"] == 0 and restore["from_checkpoint"] >= 2, restore
    assert_each_record_applied_exactly(out, tally_data, EPOCHS_HELD)
    assert_audit_exact(summary, "ps")
    # By Kueue's own log: a preempted worker's Workload had left the queue before its replacement's was made, so
    # Kueue never had both to choose from (it would admit the older one first, its pod gone).
    lives = kueue.workload_lifetimes(namespace)
    for pod in kueue_took:
        base, number = re.fullmatch(r"(.+-worker-\d+)(?:-(\d+))?", pod).groups()
        launches = {
            int(m.group(1) or 1): name
            for name in lives
            if (m := re.fullmatch(rf"pod-{re.escape(base)}(?:-(\d+))?-[0-9a-f]{{5}}", name))
        }
        old, new = launches[int(number or 1)], launches[min(n for n in launches if n > int(number or 1))]
        assert lives[old][1] is not None and lives[old][1] <= lives[new][0], (old, new, lives)


def cluster_usage(kueue, cq: str) -> dict[str, dict]:
    """Kueue's own account of a ClusterQueue's usage: {resource: {"total": .., "borrowed": ..}}."""
    status = (
        kueue.custom.get_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "clusterqueues", cq).get("status") or {}
    )
    return {r["name"]: r for f in status.get("flavorsUsage") or [] for r in f.get("resources") or []}


def test_the_job_borrows_idle_quota_in_its_cohort_and_gives_it_back(
    control_plane, kueue, core, node, kueue_namespace, tally_data, priority_classes, sa_kubeconfig, tmp_path
):
    """Its own ClusterQueue holds the core and one worker; another ClusterQueue of the same cohort lends its idle quota,
    so Kueue admits all four workers. That queue's own workload arrives: Kueue reclaims its quota, preempting the
    borrowing workers, and the job trains on with one. Once that workload ends, the job borrows again."""
    job, namespace = "cohort", kueue_namespace
    cohort, ours, theirs = f"{namespace}-cohort", f"{namespace}-a", f"{namespace}-b"
    kueue.resource_flavor(namespace)
    kueue.cluster_queue(ours, {"cpu": "1500m", "memory": "16Gi"}, cohort=cohort, flavor=namespace)
    quotas = {"cpu": "3", "memory": "16Gi"}
    kueue.cluster_queue(theirs, quotas, cohort=cohort, flavor=namespace, preemption={"reclaimWithinCohort": "Any"})
    kueue.local_queue(namespace, "team-a", ours)
    kueue.local_queue(namespace, "team-b", theirs)

    def steps(master, log):
        wait_for(lambda: registrations(log) >= 4 or master.poll() is not None, 300, what="four workers, borrowing")
        assert sorted(worker_workloads(kueue, namespace, job).values()) == ["admitted"] * 4
        assert cluster_usage(kueue, ours)["cpu"].get("borrowed") == "3", cluster_usage(kueue, ours)
        # Their own workload: Kueue reclaims the three lent cpus, from the workers that borrowed them.
        urgent_pod(core, namespace, "theirs", "team-b", "3", "elastic-low")
        wait_for(lambda: len(preempted(log)) >= 3 or master.poll() is not None, 240, what="the quota reclaimed")
        wait_for(lambda: core.read_namespaced_pod("theirs", namespace).status.phase == "Running", 120, what="theirs")
        assert len(running_workers(core, namespace, job)) <= 1
        before = registrations(log)
        # Their workload ends: the job borrows the idle quota again.
        core.delete_namespaced_pod("theirs", namespace, grace_period_seconds=0)
        wait_for(lambda: registrations(log) >= before + 3 or master.poll() is not None, 240, what="borrowing again")

    summary, text, out = run_held(
        sa_kubeconfig,
        namespace,
        tmp_path,
        tally_data,
        job,
        steps,
        diagnose=lambda: kueue.describe(namespace, (ours, theirs)),
        **QUEUED,
        queue="team-a",
    )
    losses = kueue_losses(summary)
    assert len(losses) == 3 and all(e["instance"].startswith("worker-") for e in losses), losses
    assert all("due to reclamation within the cohort" in e["detail"] for e in losses), losses  # Kueue's words
    assert_each_record_applied_exactly(out, tally_data, EPOCHS_HELD)
    assert_audit_exact(summary, "ps")


def test_a_queue_that_does_not_exist_stops_the_job_before_any_pod(
    kueue, core, node, kueue_namespace, tally_data, sa_kubeconfig, tmp_path
):
    """Kueue would keep every pod gated for ever: the master names the missing LocalQueue and the fix instead, and
    leaves nothing behind."""
    params = tally_job("no-queue", tally_data, tmp_path / "out", 1, queue="team-x")
    proc, _ = train(sa_kubeconfig, kueue_namespace, timeout=300, **params)
    assert proc.returncode != 0
    assert f"no Kueue LocalQueue 'team-x' in namespace {kueue_namespace}" in proc.stderr, proc.stderr[-3000:]
    assert f"kubectl get localqueues -n {kueue_namespace}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert job_pods(core, kueue_namespace, "no-queue") == []
    assert not secret_exists(core, kueue_namespace, "no-queue-token")
