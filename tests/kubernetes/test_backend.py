"""The kubernetes backend against the real control plane: workers and PS as pods on process-kubelet
nodes, preemption by the real kube-scheduler, the garbage collector, RBAC, a restarted master.

Every master here runs with a service-account token bound only to the shipped Role
(elastic_step/backends/manifests/role.yaml), in a pod (in-cluster config) or outside one (a
kubeconfig holding the token).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from kubernetes import client

from elastic_step import fault_hooks as faults
from elastic_step.backends.api import BackendError, EventKind, InstanceId, InstanceSpec
from elastic_step.backends.kubernetes import (
    NEEDED,
    KubernetesBackend,
    KubernetesBackendError,
    KubernetesPermissionError,
    Owner,
    load_manifests,
)
from elastic_step.backends.kubernetes.kueue import NEEDED as KUEUE_NEEDED
from elastic_step.backends.kubernetes.kueue import WANTED as KUEUE_WANTED
from elastic_step.errors import ElasticStepError
from tests.infra.kube.harness import ControlPlane, wait_for
from tests.kubernetes.fleet import PodRecorder
from tests.kubernetes.images import checkout_images
from tests.kubernetes.jobs import (
    ROOT,
    SMALL,
    STEP_IMAGE,
    WORKER_IMAGE,
    start_train,
    step_pod_env,
    train,
    train_command,
    wait_two_workers,
)
from tests.kubernetes.pod_security import restricted
from tests.models.witness import assert_exactly_once

pytestmark = pytest.mark.kubernetes

DIGITS_MODEL = str(ROOT / "samples" / "digits" / "model.py")
# The digits model with a simulated accelerator; its pods, in the image, find the digits sample it wraps on the nodes'
# shared filesystem.
SLOW = {"model_def": str(ROOT / "bench" / "models" / "slow_digits.py"), "env": f"DIGITS_SAMPLE={DIGITS_MODEL}"}
POOL = "elastic-step-test/elastic-pool"
TAINT = {"key": "elastic-step-test/dedicated", "value": "elastic", "effect": "NoSchedule"}
PLACEMENT = {"nodeSelector": {POOL: "yes"}, "tolerations": [{**TAINT, "operator": "Equal"}]}


def sleeper(ready: Path | None = None) -> list[str]:
    """A pod's program (the image's `python`) that sleeps, and exits 0 on SIGTERM. With `ready`, it touches that file
    once its handler is installed: a SIGTERM before that ends it with 143, not the 0 a test of graceful stops waits
    for (a loaded machine may take seconds to start Python)."""
    program = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    if ready is not None:
        program += f"open({str(ready)!r}, 'w').close()\n"
    return ["python", "-c", program + "time.sleep(600)"]


SLEEPER = sleeper()


# ------------------------------------------------------------------------------ helpers


def apply(api, namespace: str | None, docs: list[dict]) -> None:
    """Create the documents (ServiceAccount, Role, RoleBinding, PriorityClass); existing ones stay."""
    core, rbac, sched = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api), client.SchedulingV1Api(api)
    create = {
        "ServiceAccount": lambda d: core.create_namespaced_service_account(namespace, d),
        "Role": lambda d: rbac.create_namespaced_role(namespace, d),
        "RoleBinding": lambda d: rbac.create_namespaced_role_binding(namespace, d),
        "PriorityClass": lambda d: sched.create_priority_class(d),
    }
    for d in docs:
        try:
            create[d["kind"]](d)
        except client.ApiException as e:
            if e.status != 409:
                raise


def allowed(api, namespace: str, verbs=NEEDED) -> bool:
    auth = client.AuthorizationV1Api(api)
    return all(
        auth.create_self_subject_access_review(
            {"spec": {"resourceAttributes": {"namespace": namespace, "verb": v, "resource": r}}}
        ).status.allowed
        for v, r in verbs
    )


def step_account(cp, namespace: str, drop: tuple[str, str] | None = None) -> Path:
    """The shipped Role (minus one verb if `drop`), bound to service account elastic-step; returns a
    kubeconfig holding that account's token, once the binding is in force."""
    docs = load_manifests("role", namespace)
    if drop:
        for d in docs:
            for rule in d.get("rules", []):
                if drop[1] in rule["resources"]:
                    rule["verbs"].remove(drop[0])
    apply(cp.api_client(), namespace, docs)
    token = cp.service_account_token(namespace, "elastic-step")
    sa = cp.api_client(token)
    expect = [n for n in NEEDED if n != drop]
    wait_for(lambda: allowed(sa, namespace, expect), 20, what="the RoleBinding to take effect")
    return cp.kubeconfig_for(token, user=f"elastic-step-{namespace}")


def sleeper_pod(core, namespace: str, name: str, image: str = WORKER_IMAGE, **spec) -> client.V1Pod:
    pod = core.create_namespaced_pod(
        namespace,
        restricted(
            {
                "metadata": {"name": name},
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 2,
                    **spec,
                    "containers": [
                        {
                            "name": "main",
                            "image": image,
                            "command": SLEEPER,
                            **({"resources": spec.pop("resources")} if "resources" in spec else {}),
                        }
                    ],
                },
            }
        ),
    )
    wait_for(
        lambda: core.read_namespaced_pod(name, namespace).status.phase == "Running", 60, what=f"pod {name} running"
    )
    return pod


def intruder_pod(placement: dict, command: list[str]) -> dict:
    """A high-priority pod of 1 cpu, placed by `placement`: on a full pool, the scheduler preempts a worker for it."""
    return restricted(
        {
            "metadata": {"name": "intruder"},
            "spec": {
                "priorityClassName": "elastic-high",
                "terminationGracePeriodSeconds": 1,
                "restartPolicy": "Never",
                **placement,
                "containers": [
                    {"name": "main", "image": "x", "command": command, "resources": {"requests": {"cpu": "1"}}}
                ],
            },
        }
    )


def job_backend(
    job: str, kubeconfig: Path, namespace: str, owner: client.V1Pod | None = None, token: str = "t", **kwargs
) -> KubernetesBackend:
    """The backend of job `job` (its token `token`) with the rights `kubeconfig` holds, its pods owned by
    pod `owner` (none if None), running its image (WORKER_IMAGE without an owner, unless `image` is given)."""
    kwargs.setdefault("image", None if owner else WORKER_IMAGE)
    return KubernetesBackend(
        job,
        token,
        kubeconfig=str(kubeconfig),
        namespace=namespace,
        owner=Owner(owner.metadata.name, owner.metadata.uid) if owner else None,
        **kwargs,
    )


def job_pods(core, namespace: str, job: str) -> list[client.V1Pod]:
    return core.list_namespaced_pod(namespace, label_selector=f"elastic-step/job={job}").items


def secret_exists(core, namespace: str, name: str) -> bool:
    try:
        core.read_namespaced_secret(name, namespace)
        return True
    except client.ApiException as e:
        if e.status == 404:
            return False
        raise


class Events:
    """Collects a backend's events (the master's side of the contract)."""

    def __init__(self, backend):
        self.backend, self.seen, self.taken = backend, [], []

    def wait(self, kind: EventKind, instance: InstanceId, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in self.seen:
                if ev.kind == kind and ev.instance == instance and ev not in self.taken:
                    self.taken.append(ev)
                    return ev
            for ev in self.backend.events(0.2):
                self.seen.append(ev)
        raise AssertionError(
            f"no {kind.value} event for {instance} in {timeout}s; seen "
            f"{[(e.kind.value, str(e.instance), e.detail) for e in self.seen]}"
        )

    def kinds(self, instance: InstanceId) -> list[str]:
        for ev in self.backend.events(0.1):
            self.seen.append(ev)
        return [e.kind.value for e in self.seen if e.instance == instance]


def dense_shards(summary: dict) -> set[int]:
    """The PS shards that hold dense values: only their pushes could use shared-memory slots (embedding
    rows always travel in the message)."""
    shards = {p["shard"] for p in summary["ps"] if p["dense_parameters"]}
    assert shards, summary["ps"]
    return shards


def assert_pushes_carried_bytes(logs: dict[str, str], shards: set[int], every_worker: bool = True) -> None:
    """The production data path: a worker and a PS shard in two pods share no /dev/shm (the process
    kubelet gives each pod its own, as nodes do), so each shard of `shards` could not open the worker's
    push-slot segment and every push carried its bytes over gRPC. `logs`: worker pod name -> its log.
    With `every_worker`, each worker met every shard; otherwise (workers killed early) the job did."""
    refused = {}
    for pod, text in logs.items():
        assert "pushes go through shared memory" not in text, (pod, text[-3000:])
        refused[pod] = {
            int(m.group(1))
            for m in re.finditer(
                r"PS shard (\d+) at \S+ refused shared push slots \(cannot open /dev/shm/elastic-step-ps\1-\S+: "
                r"No such file or directory\): pushes carry their bytes",
                text,
            )
        }
    if every_worker:
        for pod, shards_refused in refused.items():
            assert shards_refused == shards, (pod, shards_refused, logs[pod][-3000:])
    else:
        assert set().union(*refused.values()) == shards, refused


def worker_logs(kubelet, namespace: str, job: str) -> dict[str, str]:
    """The logs of every worker pod of the job that ran on this kubelet (relaunches included)."""
    logs = {}
    for path in sorted(kubelet.workdir.glob(f"pods/{namespace}_{job}-worker-*_*/*.log")):
        logs[path.parent.name.split("_")[1]] = path.read_text()
    return logs


def run_job(cfg, backend):
    """TrainingJob.run() on a thread (the master in this process); returns (thread, job, result)."""
    from elastic_step.master.job import TrainingJob

    job = TrainingJob(cfg, backend=backend)
    result: dict = {}

    def target():
        try:
            result["summary"] = job.run()
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=target, name="master", daemon=True)
    t.start()
    return t, job, result


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from elastic_step.data.prep import prepare

    out = tmp_path_factory.mktemp("digits")
    r = prepare(str(ROOT / "samples" / "digits" / "digits.csv"), str(out), label="label", seed=0)
    return {"train": r.train_uri, "eval": r.eval_uri, "rows": r.train.total_rows}


@pytest.fixture(scope="module")
def priority_classes(control_plane):
    apply(control_plane.api_client(), None, load_manifests("priorityclasses"))


@pytest.fixture(scope="module")
def pool(control_plane):
    """A dedicated node with room for exactly two 1-cpu workers (the PS requests no cpu)."""
    return control_plane.add_node(
        "elastic-pool-1", cpu="2", memory="8Gi", pods=20, labels={POOL: "yes"}, taints=[TAINT]
    )


@pytest.fixture
def sa_kubeconfig(control_plane, namespace):
    return step_account(control_plane, namespace)


# ------------------------------------------------------------------------------ pods and events


def test_pods_carry_labels_owner_secret_token_and_resources(
    control_plane, core, node, namespace, sa_kubeconfig, priority_classes, tmp_path
):
    owner = sleeper_pod(core, namespace, "step", image=STEP_IMAGE)
    b = job_backend("job-shape", sa_kubeconfig, namespace, owner, token="the-token")
    try:
        check_pods_and_events(b, core, namespace, owner, tmp_path)
    finally:
        b.close()
    assert job_pods(core, namespace, "job-shape") == []
    assert not secret_exists(core, namespace, "job-shape-token")


def check_pods_and_events(b, core, namespace, owner, tmp_path):
    ev = Events(b)
    w0, ps0 = InstanceId("worker", 0), InstanceId("ps", 0)
    ready = tmp_path / "worker-0.ready"
    b.start(InstanceSpec(w0, sleeper(ready), cpu="250m", memory="128Mi"))
    b.start(InstanceSpec(ps0, SLEEPER, priority_class="elastic-high"))
    assert ev.wait(EventKind.STARTED, w0).detail == "pod job-shape-worker-0"
    ev.wait(EventKind.RUNNING, w0)
    ev.wait(EventKind.RUNNING, ps0)
    pod = core.read_namespaced_pod("job-shape-worker-0", namespace)
    assert pod.metadata.labels == {
        "elastic-step/job": "job-shape",
        "elastic-step/role": "worker",
        "elastic-step/index": "0",
        "elastic-step/launch": "1",
        "app.kubernetes.io/managed-by": "elastic-step",
    }
    ref = pod.metadata.owner_references[0]
    assert (ref.kind, ref.name, ref.uid, ref.block_owner_deletion) == ("Pod", "step", owner.metadata.uid, False)
    spec = pod.spec
    assert spec.restart_policy == "Never" and spec.termination_grace_period_seconds == 30
    assert spec.priority_class_name == "elastic-low" and spec.priority == -1000  # the default for workers
    assert core.read_namespaced_pod("job-shape-ps-0", namespace).spec.priority == 1000
    assert spec.automount_service_account_token is False
    c = spec.containers[0]
    assert c.command == sleeper(ready) and c.image == STEP_IMAGE  # the step's own image, read from its pod
    assert c.resources.requests == {"cpu": "250m", "memory": "128Mi"} == c.resources.limits
    env = {e.name: e for e in c.env}
    assert env["ELASTIC_STEP_TOKEN"].value is None
    assert env["ELASTIC_STEP_TOKEN"].value_from.secret_key_ref.name == "job-shape-token"
    assert env["ELASTIC_STEP_POD_IP"].value_from.field_ref.field_path == "status.podIP"
    assert "the-token" not in json.dumps(client.ApiClient().sanitize_for_serialization(pod))
    secret = core.read_namespaced_secret("job-shape-token", namespace)
    assert secret.metadata.owner_references[0].uid == owner.metadata.uid
    # graceful stop -> EXITED with the process's code; kill -> LOST; a relaunch gets a fresh name
    wait_for(ready.exists, 60, what="worker-0's SIGTERM handler installed")
    b.stop(w0, grace_s=5)
    assert ev.wait(EventKind.EXITED, w0).exit_code == 0
    b.start(InstanceSpec(w0, SLEEPER))
    ev.wait(EventKind.RUNNING, w0)
    assert b.pod_name(w0) == "job-shape-worker-0-2"
    b.kill(w0)
    assert "killed" in ev.wait(EventKind.LOST, w0).detail
    assert b.alive() == {ps0}


# ------------------------------------------------------------------------------ training


def test_digits_trains_with_the_master_in_a_pod(
    control_plane, core, node, namespace, digits, priority_classes, tmp_path
):
    """The step as Kubernetes runs it: the master is a pod of service account elastic-step (in-cluster
    config, namespace from the token's directory, owner = its own pod via the downward API), with the
    default backend, auto: in a pod whose service account holds the Role's verbs, that means pods."""
    step_account(control_plane, namespace)
    recorder = PodRecorder(core, namespace)
    out, job = tmp_path / "out", "digits-k8s"
    env = [
        {"name": n, "valueFrom": {"fieldRef": {"fieldPath": f}}}
        for n, f in (("POD_NAME", "metadata.name"), ("POD_UID", "metadata.uid"), ("POD_IP", "status.podIP"))
    ]
    env.append({"name": "KUBECONFIG", "value": ""})
    t0 = time.monotonic()
    core.create_namespaced_pod(
        namespace,
        restricted(
            {
                "metadata": {"name": "step"},
                "spec": {
                    "serviceAccountName": "elastic-step",
                    "restartPolicy": "Never",
                    "priorityClassName": "elastic-high",
                    "containers": [
                        {
                            "name": "main",
                            "image": WORKER_IMAGE,
                            "env": env,
                            "command": train_command(
                                python="python",
                                job_id=job,
                                model_def=DIGITS_MODEL,
                                train_data=digits["train"],
                                eval_data=digits["eval"],
                                output=out,
                                epochs=40,
                                **SMALL,
                                num_ps=1,
                                progress="lines",
                            ),
                        }
                    ],
                },
            }
        ),
    )
    pod = wait_for(
        lambda: (p := core.read_namespaced_pod("step", namespace)).status.phase in ("Succeeded", "Failed") and p,
        600,
        interval=1,
        what="the master pod to finish",
    )
    took = time.monotonic() - t0
    log = node.log_path(namespace, "step").read_text()
    assert pod.status.phase == "Succeeded", log[-4000:]
    recorder.stop()
    summary = json.loads((out / "summary.json").read_text())
    assert_exactly_once(summary)
    assert summary["backend"] == "kubernetes" and "backend auto -> kubernetes: this step runs in a pod" in log
    assert summary["eval"]["accuracy"] >= 0.90, summary["eval"]
    assert summary["workers"]["max_alive"] == 2
    # workers and PS ran as pods of this job, owned by the step's pod, on the process kubelet
    ours = {n: o for n, o in recorder.seen.items() if n.startswith(job)}
    assert set(ours) == {f"{job}-ps-0", f"{job}-worker-0", f"{job}-worker-1"}, sorted(ours)
    for o in ours.values():
        assert o["metadata"]["ownerReferences"][0]["uid"] == pod.metadata.uid
        assert o["spec"]["nodeName"] == "node-1"
        assert o["spec"]["containers"][0]["image"] == pod.spec.containers[0].image  # the step's, read from its pod
    master_ip = pod.status.pod_ip
    assert all(f"--master {master_ip}:" in " ".join(o["spec"]["containers"][0]["command"]) for o in ours.values())
    # pods on one node share no /dev/shm: pushes went as bytes over gRPC, as between two nodes
    logs = worker_logs(node, namespace, job)
    assert set(logs) == {f"{job}-worker-0", f"{job}-worker-1"}, sorted(logs)
    assert_pushes_carried_bytes(logs, dense_shards(summary))
    # afterwards no job pod is left, nor the token Secret
    assert job_pods(core, namespace, job) == []
    assert not secret_exists(core, namespace, f"{job}-token")
    print(
        f"\ndigits on Kubernetes: master pod ran {took:.1f}s, training {summary['training_seconds']:.1f}s, "
        f"{summary['throughput_records_per_s']:.0f} rec/s, accuracy {summary['eval']['accuracy']:.4f}"
    )


def test_preempted_worker_is_requeued_relaunched_and_rejoins(
    control_plane, core, namespace, digits, pool, priority_classes, sa_kubeconfig, tmp_path
):
    from elastic_step.master.api import TrainConfig

    job = "preempt"
    cfg = TrainConfig(
        **SLOW,
        train_data=digits["train"],
        eval_data=None,
        output=str(tmp_path / "out"),
        epochs=25,
        **SMALL,
        min_workers=1,
        num_ps=1,
        backend="kubernetes",
        job_id=job,
        worker_cpu="1",
        worker_memory="256Mi",
        worker_priority_class="elastic-low",
        ps_priority_class="elastic-high",
        worker_image=WORKER_IMAGE,
        progress="off",
    )
    backend = KubernetesBackend.from_train_config(
        cfg, job, "preempt-token", kubeconfig=str(sa_kubeconfig), namespace=namespace, pod_spec=PLACEMENT, owner=None
    )
    recorder = PodRecorder(core, namespace)
    thread, master, result = run_job(cfg, backend)
    coord, ledger = master.coord, master.ledger
    try:
        preemption_scenario(core, namespace, job, backend, coord, ledger, thread, result, recorder)
    except AssertionError as e:
        pods = {
            n: (
                (o.get("status") or {}).get("phase"),
                o["spec"].get("nodeName"),
                bool(o["metadata"].get("deletionTimestamp")),
            )
            for n, o in recorder.current.items()
        }
        raise AssertionError(
            f"{e}\nmaster events: {coord.timeline.events[-25:]}\npods: {pods}\n"
            f"ledger: {ledger.records_committed_total()} committed, leases {ledger.leases}"
        ) from None


def preemption_scenario(core, namespace, job, backend, coord, ledger, thread, result, recorder):

    def training() -> int:
        return len(coord.membership.training())

    # both workers train on the full node
    wait_for(
        lambda: training() == 2 and ledger.records_committed_total() > 3000 or result,
        240,
        interval=0.2,
        what="two workers training",
    )
    assert not result, result
    t_full = ledger.records_committed_total()
    # a high-priority pod that does not fit: the real scheduler preempts a worker
    t0 = time.monotonic()
    intruder = intruder_pod(PLACEMENT, ["sleep", "600"])  # another team's program
    core.create_namespaced_pod(namespace, intruder)
    lost = wait_for(lambda: [e for e in coord.timeline.events if e["kind"] == "lost"], 60, what="a worker lost")[0]
    victim = lost["instance"]
    assert "preempted by the scheduler" in lost["detail"], lost
    wait_for(
        lambda: core.read_namespaced_pod("intruder", namespace).status.phase == "Running",
        60,
        what="the intruder running",
    )
    t_preempted = time.monotonic() - t0
    # the master keeps training with one worker; the relaunched one waits, pending, for room
    at_loss = ledger.records_committed_total()
    wait_for(lambda: ledger.records_committed_total() > at_loss + 1500 or result, 120, what="training with one worker")
    assert not result and training() == 1, result
    relaunch = backend.pod_name(InstanceId("worker", int(victim.rsplit("-", 1)[1])))
    assert relaunch.endswith("-2"), relaunch
    pending = wait_for(
        lambda: (
            (p := core.read_namespaced_pod(relaunch, namespace)).status.phase == "Pending"
            and any(c.reason == "Unschedulable" for c in p.status.conditions or [])
            and p
        ),
        60,
        what="the relaunched worker pending as unschedulable",
    )
    assert pending.spec.node_name is None
    # room again: the pending worker is scheduled and joins
    core.delete_namespaced_pod("intruder", namespace, grace_period_seconds=0)
    t1 = time.monotonic()
    wait_for(lambda: training() == 2 or result, 180, what="the relaunched worker rejoining")
    t_rejoin = time.monotonic() - t1
    assert not result.get("error"), result
    thread.join(600)
    recorder.stop()
    assert not thread.is_alive()
    assert "error" not in result, result.get("error")
    summary = result["summary"]
    assert_exactly_once(summary)
    kinds = [(e["kind"], e["instance"]) for e in summary["events"]]
    assert kinds.count(("registered", victim)) == 2, kinds
    # The victim finished and reported its minibatch in its grace period before the loss was reported:
    # nothing refused, and whatever remained of its task (unless it ended on the task's last
    # minibatch) was requeued and trained by the others.
    assert not [k for k in kinds if k[0] == "refused"], kinds
    requeued = [e["detail"] for e in summary["events"] if e["kind"] == "requeued" and e["instance"] == victim]
    assert summary["workers"]["lost"] == 1 and summary["workers"]["relaunched"] == 1
    # the timeline shows the dip and the recovery
    alive = [(s["t"], s["alive"]) for s in summary["workers_alive"]]
    t_lost = lost["t"] - 0.001  # samples are rounded to the millisecond
    assert max(a for t, a in alive if t < t_lost) == 2
    assert [a for t, a in alive if t >= t_lost][0] == 1
    assert max(a for t, a in alive if t > t_lost) == 2
    assert recorder.max_live[(job, "worker", victim.rsplit("-", 1)[1])] == 1
    assert job_pods(core, namespace, job) == []
    print(
        f"\npreemption: {victim} lost {t_preempted:.1f}s after the high-priority pod was created (at {t_full} "
        f"records; requeued {requeued or 'nothing: it ended on a task boundary'}); relaunched worker rejoined "
        f"{t_rejoin:.1f}s after room freed; {summary['ledger']['records_committed']} records, exact"
    )


# ------------------------------------------------------------------------------ ownership


def test_deleting_the_owner_pod_garbage_collects_the_job(control_plane, core, node, namespace, sa_kubeconfig):
    owner = sleeper_pod(core, namespace, "step")
    b = job_backend("job-gc", sa_kubeconfig, namespace, owner)
    ev = Events(b)
    insts = [InstanceId("ps", 0), InstanceId("worker", 0), InstanceId("worker", 1)]
    for i in insts:
        b.start(InstanceSpec(i, SLEEPER))
    for i in insts:
        ev.wait(EventKind.RUNNING, i)
    t0 = time.monotonic()
    core.delete_namespaced_pod("step", namespace)
    wait_for(
        lambda: not job_pods(core, namespace, "job-gc") and not secret_exists(core, namespace, "job-gc-token"),
        120,
        what="the garbage collector to delete the job's pods and Secret",
    )
    took = time.monotonic() - t0
    for i in insts:  # the master (if it were alive) hears of each deletion as a loss
        ev.wait(EventKind.LOST, i)
    b.close()
    print(f"\ngarbage collector: job pods gone {took:.1f}s after the owner's deletion")


# ------------------------------------------------------------------------------ permissions


def test_missing_delete_permission_fails_the_master_naming_it(control_plane, core, namespace, digits, tmp_path):
    kubeconfig = step_account(control_plane, namespace, drop=("delete", "pods"))
    t0 = time.monotonic()
    proc, _ = train(
        kubeconfig,
        namespace,
        timeout=300,
        job_id="no-delete",
        model_def=DIGITS_MODEL,
        train_data=digits["train"],
        output=tmp_path / "out",
        progress="off",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = [l for l in proc.stderr.splitlines() if l.startswith("elastic-step: error:")][-1]
    assert line == (
        f"elastic-step: error: the service account system:serviceaccount:{namespace}:elastic-step "
        f"cannot delete pods in namespace {namespace}: add 'delete' on 'pods' to its Role "
        "(see elastic_step/backends/manifests/role.yaml)."
    ), line
    # it failed before creating anything it could not clean up
    assert job_pods(core, namespace, "no-delete") == []
    assert not secret_exists(core, namespace, "no-delete-token")
    print(f"\nmissing permission reported in {time.monotonic() - t0:.1f}s")


def test_forbidden_call_names_verb_and_resource(control_plane, core, namespace):
    kubeconfig = step_account(control_plane, namespace, drop=("create", "pods"))
    b = job_backend("no-create", kubeconfig, namespace, preflight=False)
    try:
        with pytest.raises(KubernetesPermissionError) as e:
            b.start(InstanceSpec(InstanceId("worker", 0), SLEEPER))
        assert isinstance(e.value, BackendError) and isinstance(e.value, ElasticStepError)
        assert str(e.value) == (
            f"the service account system:serviceaccount:{namespace}:elastic-step cannot "
            f"create pods in namespace {namespace}: add 'create' on 'pods' to its Role "
            "(see elastic_step/backends/manifests/role.yaml)."
        )
        assert b.alive() == set()
    finally:
        b.close()


def test_unknown_priority_class_names_it_and_the_fix(control_plane, core, node, namespace, sa_kubeconfig):
    b = job_backend("no-class", sa_kubeconfig, namespace)
    try:
        with pytest.raises(KubernetesBackendError) as e:
            b.start(InstanceSpec(InstanceId("worker", 0), SLEEPER, priority_class="elastic-nope"))
        assert "no PriorityClass with name elastic-nope" in str(e.value), e.value
        assert "priorityclasses.yaml" in str(e.value) and "--worker-priority-class" in str(e.value), e.value
        assert b.alive() == set() and job_pods(core, namespace, "no-class") == []
    finally:
        b.close()


# ------------------------------------------------------------------------------ restart / adoption


def test_restarted_master_adopts_its_pods_without_duplicates(
    control_plane, core, node, namespace, digits, priority_classes, sa_kubeconfig, tmp_path
):
    """Master 1 is SIGKILLed while training (it cleans nothing up); master 2 (a retried step: another
    owner pod, same job id) adopts the pods it finds and never runs two pods of one instance."""
    job = "restart"
    attempt1 = sleeper_pod(core, namespace, "attempt-1")
    attempt2 = sleeper_pod(core, namespace, "attempt-2")
    recorder = PodRecorder(core, namespace)

    def master(attempt, epochs: int, log: Path) -> subprocess.Popen:
        return start_train(
            sa_kubeconfig,
            namespace,
            log,
            step_env=step_pod_env(attempt),
            job_id=job,
            **SLOW,
            train_data=digits["train"],
            output=tmp_path / attempt.metadata.name,
            epochs=epochs,
            **SMALL,
            progress="lines",
        )

    log1, log2 = tmp_path / "master-1.log", tmp_path / "master-2.log"
    m1 = master(attempt1, 200, log1)
    try:
        # killed while both workers train: each has pushed gradients (its first push logs the path)
        wait_two_workers(m1, log1, "master 1 training with two workers")
        wait_for(
            lambda: (
                [n for n, text in worker_logs(node, namespace, job).items() if "PS shard 0" in text]
                == [f"{job}-worker-0", f"{job}-worker-1"]
                or m1.poll() is not None
            ),
            240,
            interval=0.5,
            what="both workers of master 1 pushing gradients",
        )
        assert m1.poll() is None, log1.read_text()[-3000:]
    finally:
        m1.send_signal(signal.SIGKILL)
        m1.wait()
    before = {p.metadata.name: p for p in job_pods(core, namespace, job)}
    assert {f"{job}-ps-0", f"{job}-worker-0", f"{job}-worker-1"} <= set(before), sorted(before)
    t0 = time.monotonic()
    m2 = master(attempt2, 6, log2)
    try:
        rc = m2.wait(600)
    finally:
        if m2.poll() is None:
            m2.kill()
    took = time.monotonic() - t0
    recorder.stop()
    text = log2.read_text()
    assert rc == 0, text[-4000:]
    assert "adopting" in text and f"{job}-worker-0" in text.split("adopting", 1)[1].splitlines()[0], text[-4000:]
    summary = json.loads((tmp_path / "attempt-2" / "summary.json").read_text())
    assert_exactly_once(summary)
    started = [e["detail"] for e in summary["events"] if e["kind"] == "started"]
    assert any(d.startswith(f"replaces adopted pod {job}-worker-") for d in started), started
    # never two live pods of one instance, the new ones owned by the retried step's pod
    for key, n in recorder.max_live.items():
        assert n == 1, (key, n)
    new = [o for n, o in recorder.seen.items() if n.startswith(job) and n not in before]
    assert new and all(o["metadata"]["ownerReferences"][0]["uid"] == attempt2.metadata.uid for o in new)
    assert job_pods(core, namespace, job) == []
    assert not secret_exists(core, namespace, f"{job}-token")
    adopting = next(l for l in text.splitlines() if "adopting" in l).split(": ", 1)[1]
    print(
        f"\nrestarted master: found {sorted(before)}; {adopting}; events: "
        f"{[(e['instance'], e['detail']) for e in summary['events'] if e['kind'] == 'started']}; "
        f"finished {took:.1f}s after its start"
    )


def test_sigterm_to_the_master_deletes_the_job_pods(
    control_plane, core, node, namespace, digits, sa_kubeconfig, tmp_path
):
    """The step's pod is being deleted: its master gets SIGTERM and deletes every pod of the job."""
    log = tmp_path / "master.log"
    m = start_train(
        sa_kubeconfig,
        namespace,
        log,
        job_id="term",
        **SLOW,
        train_data=digits["train"],
        output=tmp_path / "out",
        epochs=200,
        max_workers=2,
        progress="off",
    )
    try:
        wait_two_workers(m, log, "the master training with two workers")
        assert len(job_pods(core, namespace, "term")) == 3
        t0 = time.monotonic()
        m.send_signal(signal.SIGTERM)
        rc = m.wait(60)
        took = time.monotonic() - t0
    finally:
        if m.poll() is None:
            m.kill()
    text = log.read_text()
    assert rc == 143 and "terminated (SIGTERM)" in text, text[-3000:]  # 143: a retry policy retries it
    assert job_pods(core, namespace, "term") == []
    assert not secret_exists(core, namespace, "term-token")
    print(f"\nSIGTERM: master exited {took:.1f}s later with no job pod left")


def test_adopted_pod_with_the_same_command_is_kept_and_reowned(control_plane, core, node, namespace, sa_kubeconfig):
    o1, o2 = sleeper_pod(core, namespace, "attempt-1"), sleeper_pod(core, namespace, "attempt-2")
    w0, w1 = InstanceId("worker", 0), InstanceId("worker", 1)
    recorder = PodRecorder(core, namespace)
    a = job_backend("job-adopt", sa_kubeconfig, namespace, o1, token="token-a")
    ev_a = Events(a)
    other = SLEEPER[:-1] + [SLEEPER[-1] + "  # master A"]
    a.start(InstanceSpec(w0, SLEEPER))
    a.start(InstanceSpec(w1, other))
    ev_a.wait(EventKind.RUNNING, w0)
    ev_a.wait(EventKind.RUNNING, w1)
    uid0 = core.read_namespaced_pod("job-adopt-worker-0", namespace).metadata.uid
    a.abandon()  # master A dies without cleaning up

    b = job_backend("job-adopt", sa_kubeconfig, namespace, o2, token="token-b")
    ev_b = Events(b)
    try:
        assert b.token == "token-a" and b.token_reused  # the job's Secret keeps its token
        assert b.adopted == {w0: "job-adopt-worker-0", w1: "job-adopt-worker-1"}
        b.start(InstanceSpec(w0, SLEEPER))  # the same command: kept
        assert ev_b.wait(EventKind.STARTED, w0).detail == "adopted pod job-adopt-worker-0"
        ev_b.wait(EventKind.RUNNING, w0)
        pod = core.read_namespaced_pod("job-adopt-worker-0", namespace)
        assert pod.metadata.uid == uid0
        assert [r.uid for r in pod.metadata.owner_references] == [o2.metadata.uid]
        assert (
            core.read_namespaced_secret("job-adopt-token", namespace).metadata.owner_references[0].uid
            == o2.metadata.uid
        )
        b.start(InstanceSpec(w1, SLEEPER))  # another command (another master): replaced
        assert ev_b.wait(EventKind.STARTED, w1).detail.startswith("replaces adopted pod job-adopt-worker-1")
        ev_b.wait(EventKind.RUNNING, w1)
        assert b.pod_name(w1) == "job-adopt-worker-1-2"
        assert sorted(
            p.metadata.name for p in job_pods(core, namespace, "job-adopt") if not p.metadata.deletion_timestamp
        ) == ["job-adopt-worker-0", "job-adopt-worker-1-2"]
        with pytest.raises(BackendError):
            b.start(InstanceSpec(w0, SLEEPER))  # no duplicate of a running instance
    finally:
        b.close()
        recorder.stop()
    assert recorder.max_live[("job-adopt", "worker", "0")] == 1
    assert recorder.max_live[("job-adopt", "worker", "1")] == 1
    assert job_pods(core, namespace, "job-adopt") == []


# ------------------------------------------------------------------------------ watch: 410 Gone


class WatchHold:
    """Holds one backend's pod watch at its hook point (faults.WATCH_REQUEST): from `hold` until `release`
    it opens no request, and what the job's pods do meanwhile goes unseen."""

    def __init__(self, backend: KubernetesBackend):
        self.watch = backend._watch
        self._holding, self._held = threading.Event(), threading.Event()

    def _at_request(self, watch) -> None:
        if watch is not self.watch or not self._holding.is_set():
            return
        self._held.set()
        while self._holding.is_set() and not watch.closed.is_set():
            time.sleep(0.05)

    def hold(self) -> None:
        faults.WATCH_REQUEST.install(self._at_request)
        self._holding.set()
        self.watch.wake()
        if not self._held.wait(10):
            raise RuntimeError("the watch did not pause")

    def release(self) -> None:
        self._holding.clear()
        faults.WATCH_REQUEST.install(None)


def test_watch_relists_after_410_gone_and_catches_up(tmp_path):
    """The watch is held while pods change, etcd is compacted past its resourceVersion, and on
    resuming the apiserver answers 410 Gone: the backend re-lists and reports what it missed.
    A control plane of its own, with the watch cache off, so the watch reads etcd itself."""
    with ControlPlane(
        extra_args={"kube-apiserver": ["--watch-cache=false"]}, node_defaults={"images": checkout_images()}
    ) as cp:
        cp.add_node("n410", cpu="4", memory="8Gi", pods=20)
        ns = "watch-410"
        cp.create_namespace(ns)
        core = client.CoreV1Api(cp.api_client())
        kubeconfig = step_account(cp, ns)
        b = job_backend("job-410", kubeconfig, ns, watch_timeout_s=2)
        ev = Events(b)
        held = WatchHold(b)
        w0, w1, w2 = (InstanceId("worker", i) for i in range(3))
        quits = [
            "python",
            "-c",
            "import os, pathlib, sys, time\n"
            "while not (pathlib.Path(sys.argv[1]) / os.environ['HOSTNAME']).exists(): time.sleep(0.1)\n"
            "raise SystemExit(7)",
            str(tmp_path),
        ]
        try:
            for i in (w0, w1):
                b.start(InstanceSpec(i, quits))
            for i in (w0, w1):
                ev.wait(EventKind.RUNNING, i)
            # a few watch timeouts (2 s each): each resumed from the last resourceVersion, no re-list
            wait_for(lambda: b.stats["watches"] >= 3, 60, what="three watches")
            assert b.stats["relists"] == 0 and b.stats["gone_410"] == 0, b.stats
            held.hold()
            b.start(InstanceSpec(w2, SLEEPER))  # created while nobody watches
            core.delete_namespaced_pod("job-410-worker-0", ns, grace_period_seconds=0)
            (tmp_path / "job-410-worker-1").touch()
            wait_for(
                lambda: core.read_namespaced_pod("job-410-worker-1", ns).status.phase == "Failed",
                30,
                what="worker-1 to exit",
            )
            wait_for(
                lambda: core.read_namespaced_pod("job-410-worker-2", ns).status.phase == "Running",
                30,
                what="worker-2 running",
            )
            rv = core.list_namespaced_pod(ns).metadata.resource_version
            etcd = next(
                a.split("=", 1)[1] for a in cp.processes()["kube-apiserver"].args if a.startswith("--etcd-servers=")
            )
            urllib.request.urlopen(
                urllib.request.Request(
                    etcd + "/v3/kv/compaction", data=json.dumps({"revision": rv, "physical": True}).encode()
                )
            )
            assert ev.kinds(w0) == ["started", "running"]
            held.release()
            assert "deleted" in ev.wait(EventKind.LOST, w0, 30).detail
            assert ev.wait(EventKind.EXITED, w1, 30).exit_code == 7
            ev.wait(EventKind.RUNNING, w2, 30)
            assert b.stats["gone_410"] == 1 and b.stats["relists"] == 1, b.stats
            assert b.alive() == {w2}
        finally:
            held.release()
            b.close()
        assert job_pods(core, ns, "job-410") == []


# ------------------------------------------------------------------------------ manifests


def test_shipped_role_is_namespaced_exact_and_matches_the_component_rbac():
    docs = {d["kind"]: d for d in load_manifests("role")}
    assert set(docs) == {"ServiceAccount", "Role", "RoleBinding"}
    rules = {tuple(r["resources"]): set(r["verbs"]) for r in docs["Role"]["rules"]}
    assert rules == {
        ("pods",): {"create", "get", "list", "watch", "delete", "patch"},
        ("secrets",): {"create", "get", "delete"},
        ("localqueues",): {"get"},
        ("workloads",): {"list"},
        ("events",): {"create", "patch"},
    }
    needed: dict = {}
    for verb, resource in NEEDED + tuple((v, r) for v, r, _ in (*KUEUE_NEEDED, *KUEUE_WANTED)):
        needed.setdefault((resource,), set()).add(verb)
    # Exactly what the backend checks for (a queue: localqueues, and the workloads it reads to explain a wait), no
    # wildcard; besides, the step's Events, whose lack costs a line of the log and not the job.
    assert {k: v for k, v in rules.items() if k != ("events",)} == needed
    import yaml

    component = {
        d["kind"]: d for d in yaml.safe_load_all((ROOT / "components" / "elastic_train" / "rbac.yaml").read_text())
    }
    assert component["Role"]["rules"] == docs["Role"]["rules"]
    pcs = {d["metadata"]["name"]: d for d in load_manifests("priorityclasses")}
    assert pcs["elastic-low"]["value"] < 0 < pcs["elastic-high"]["value"]
    assert pcs["elastic-low"]["preemptionPolicy"] == "Never"
