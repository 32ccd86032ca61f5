"""Argo Workflows' own controller on the test control plane: its pods (init, wait and main
containers, the emissary executor) run on the process kubelet, and Argo decides the outcome."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from elastic_step.backends.kubernetes.security import CONTAINER_SECURITY_CONTEXT, POD_SECURITY_CONTEXT
from tests.infra.kube.harness import wait_for
from tests.infra.kube.harness.argo import ArgoController
from tests.infra.kube.harness.process import stopped
from tests.kubernetes.pod_security import restricted_container
from tests.kubernetes.test_backend import PodRecorder, intruder_pod, priority_classes  # noqa: F401

pytestmark = pytest.mark.kubernetes

REPO = Path(__file__).resolve().parents[2]
PROJECT_IMAGE = "ghcr.io/elastic-step/elastic-step"  # the shipped YAMLs' image: this checkout's environment


@pytest.fixture(scope="module")
def argo(control_plane, node):
    # Argo's own init and wait containers run under the controller's executor settings: a platform that enforces
    # the restricted Pod Security level sets their security context there, as here (docs/kubernetes.md).
    executor = {"securityContext": CONTAINER_SECURITY_CONTEXT}
    with ArgoController(control_plane, config={"executor": executor}) as controller:
        node.images.update(controller.images)
        yield controller


@pytest.fixture
def workflows(control_plane):
    return client.CustomObjectsApi(control_plane.api_client())


def apply_rbac(control_plane, namespace):
    """The shipped RBAC: the `elastic-step` account and what Argo's executor needs."""
    from kubernetes import utils

    for f in ("components/elastic_train/rbac.yaml", "pipelines/argo/rbac.yaml"):
        for doc in yaml.safe_load_all((REPO / f).read_text()):
            if doc:
                utils.create_from_dict(control_plane.api_client(), doc, namespace=namespace)


def workflow_body(name: str, **spec) -> dict:
    """An Argo Workflow named `name` with these `spec` fields."""
    return {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": name}, "spec": spec}


def finished(workflows, namespace, name, timeout=180.0):
    def done():
        wf = workflows.get_namespaced_custom_object("argoproj.io", "v1alpha1", namespace, "workflows", name)
        return wf if (wf.get("status") or {}).get("phase") in ("Succeeded", "Failed", "Error") else None

    return wait_for(done, timeout, interval=0.5, what=f"workflow {namespace}/{name} to finish")


def _task(node_name: str) -> str:
    """The DAG task of a node name: `wf.task`, or `wf.task(0)` for an attempt of a retried task."""
    return re.sub(r"\(\d+\)$", "", node_name.rsplit(".", 1)[-1])


def pod_logs(control_plane, namespace, workflow: str, task: str = "", tail: int = 2000) -> str:
    """The logs the kubelets kept of the workflow's pods (those of `task` only, if given; deleted
    ones too), each container's last `tail` characters. Argo names a pod `<workflow>-<template>-<id>`,
    and the shipped templates are named as their tasks."""
    out = []
    prefix = f"{workflow}-{task}-" if task else f"{workflow}-"
    for kubelet in control_plane.nodes.values():
        for path in sorted(
            (kubelet.workdir / "pods").glob(f"{namespace}_{prefix}*/*.log"), key=lambda p: p.stat().st_mtime
        ):
            out.append(f"--- {path.parent.name.split('_')[1]}/{path.stem}\n{path.read_text(errors='replace')[-tail:]}")
    return "\n".join(out)


def assert_succeeded(done: dict, control_plane, namespace: str, workflow: str, *more: str) -> None:
    """The workflow succeeded. If not, the failed steps' messages, and its pods' logs printed whole beside the
    failure: pytest cuts an assertion's message short, and a step's cause is in the last lines of its log."""
    status = done["status"]
    if status["phase"] == "Succeeded":
        return
    print(pod_logs(control_plane, namespace, workflow, tail=20000), *more, sep="\n")
    failed = [
        (n["displayName"], n["phase"], n.get("message"))
        for n in status.get("nodes", {}).values()
        if n["type"] == "Pod" and n["phase"] not in ("Succeeded", "Skipped", "Omitted")
    ]
    pytest.fail(f"workflow {workflow} {status['phase']} ({status.get('message')}); its failed steps: {failed}")


def test_a_dag_passing_a_parameter_runs_to_success_on_argos_controller(control_plane, node, argo, workflows, namespace):
    apply_rbac(control_plane, namespace)
    image = f"{PROJECT_IMAGE}:0.1.0"
    work = {"name": "work", "mountPath": "/work"}
    wf = workflow_body(
        "hello",
        entrypoint="main",
        serviceAccountName="elastic-step",
        securityContext=POD_SECURITY_CONTEXT,  # the namespace is restricted
        templates=[
            {
                "name": "main",
                "dag": {
                    "tasks": [
                        {"name": "say", "template": "say"},
                        {
                            "name": "echo",
                            "template": "echo",
                            "dependencies": ["say"],
                            "arguments": {
                                "parameters": [{"name": "msg", "value": "{{tasks.say.outputs.parameters.msg}}"}]
                            },
                        },
                    ]
                },
            },
            {
                "name": "say",
                "volumes": [{"name": "work", "emptyDir": {}}],
                "container": restricted_container(
                    {
                        "image": image,
                        "volumeMounts": [work],
                        "command": [
                            "python",
                            "-c",
                            "import platform; open('/work/msg', 'w').write('hi from ' + platform.node())",
                        ],
                    }
                ),
                "outputs": {"parameters": [{"name": "msg", "valueFrom": {"path": "/work/msg"}}]},
            },
            {
                "name": "echo",
                "inputs": {"parameters": [{"name": "msg"}]},
                "container": restricted_container(
                    {
                        "image": image,
                        "command": [
                            "python",
                            "-c",
                            "import sys; print('got', sys.argv[1])",
                            "{{inputs.parameters.msg}}",
                        ],
                    }
                ),
            },
        ],
    )
    workflows.create_namespaced_custom_object("argoproj.io", "v1alpha1", namespace, "workflows", wf)
    done = finished(workflows, namespace, "hello")
    nodes = done["status"]["nodes"].values()
    assert_succeeded(done, control_plane, namespace, "hello", argo.log()[-3000:])
    say = next(n for n in nodes if n.get("displayName") == "say")
    msg = next(p["value"] for p in say["outputs"]["parameters"] if p["name"] == "msg")
    assert msg.startswith("hi from ")
    assert f"got {msg}" in pod_logs(control_plane, namespace, "hello", "echo")


# ------------------------------------------------------------------------------ the shipped template

TEMPLATE = REPO / "pipelines" / "argo" / "train-eval-template.yaml"
CRON = REPO / "pipelines" / "argo" / "train-eval-cron.yaml"
EPOCHS = 3


def _s3(s3):
    """A client of moto's server, with the keys the artifact repository's Secret holds."""
    import boto3

    return boto3.client(
        "s3", endpoint_url=s3.url, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    )


def artifact_repository(control_plane, namespace, s3, bucket):
    """The namespace's default artifact repository, as a platform team sets one up: S3 (moto's
    server) with its keys in a Secret, named by the `artifact-repositories` ConfigMap."""
    _s3(s3).create_bucket(Bucket=bucket)
    core = client.CoreV1Api(control_plane.api_client())
    core.create_namespaced_secret(
        namespace,
        {"metadata": {"name": "artifacts-s3"}, "stringData": {"accesskey": "testing", "secretkey": "testing"}},
    )
    repo = {
        "s3": {
            "bucket": bucket,
            "endpoint": s3.url.split("://", 1)[1],
            "insecure": True,
            "region": "us-east-1",
            "keyFormat": "{{workflow.name}}/{{pod.name}}",
            "accessKeySecret": {"name": "artifacts-s3", "key": "accesskey"},
            "secretKeySecret": {"name": "artifacts-s3", "key": "secretkey"},
        }
    }
    core.create_namespaced_config_map(
        namespace,
        {
            "metadata": {
                "name": "artifact-repositories",
                "annotations": {"workflows.argoproj.io/default-artifact-repository": "default"},
            },
            "data": {"default": yaml.safe_dump(repo)},
        },
    )


def s3_artifact(s3, bucket: str, node: dict, name: str, into: Path) -> Path:
    """A node's output artifact, fetched from where Argo's status says it put it, unpacked."""
    import io
    import tarfile

    art = next(a for a in node["outputs"]["artifacts"] if a["name"] == name)
    body = _s3(s3).get_object(Bucket=bucket, Key=art["s3"]["key"])["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        tar.extractall(into, filter="data")
    return into


def shipped_template() -> dict:
    return yaml.safe_load(TEMPLATE.read_text())


def shipped_template_probe() -> dict:
    """The training step's liveness probe's httpGet, as the shipped template has it."""
    train = next(t for t in shipped_template()["spec"]["templates"] if t["name"] == "elastic-train")
    return train["container"]["livenessProbe"]["httpGet"]


@pytest.fixture
def pipeline_ns(control_plane, namespace, s3_server, priority_classes):
    """A namespace set up as pipelines/argo/README.md tells a platform team: the shipped RBAC, an
    artifact repository, the shipped WorkflowTemplate."""
    apply_rbac(control_plane, namespace)
    artifact_repository(control_plane, namespace, s3_server, "artifacts")
    return namespace


def submit(workflows, namespace: str, name: str, params: dict, template: dict | None = None, **spec) -> None:
    """A Workflow from the WorkflowTemplate (created first when ``template`` is given), with ``params``
    and further workflow ``spec`` fields (placement, service account)."""
    group = ("argoproj.io", "v1alpha1", namespace)
    if template is not None:
        workflows.create_namespaced_custom_object(*group, "workflowtemplates", template)
    workflow = workflow_body(
        name,
        workflowTemplateRef={"name": "elastic-step-train-eval"},
        arguments={"parameters": [{"name": k, "value": v} for k, v in params.items()]},
        **spec,
    )
    for _ in range(5):
        workflows.create_namespaced_custom_object(*group, "workflows", workflow)
        if template is None:
            return
        # The controller looks the template up in its informer's cache, which may not hold the one created
        # a moment ago: it then ends the workflow at once in Error, "... not found" (seen once in CI;
        # argoproj/argo-workflows#14615). Only then is the workflow submitted again; any other start stands.
        status = wait_for(
            lambda: _started(workflows, group, name),
            120,
            interval=0.2,
            what=f"Argo's controller to take up workflow {namespace}/{name}",
        )
        if status["phase"] != "Error" or "workflowtemplates.argoproj.io" not in status.get("message", ""):
            return
        workflows.delete_namespaced_custom_object(*group, "workflows", name)
        wait_for(
            lambda: (
                not any(
                    w["metadata"]["name"] == name
                    for w in workflows.list_namespaced_custom_object(*group, "workflows")["items"]
                )
            ),
            60,
            what=f"workflow {namespace}/{name} deleted",
        )
    raise AssertionError(f"Argo's controller never found the WorkflowTemplate for {namespace}/{name}")


def _started(workflows, group: tuple, name: str) -> dict | None:
    status = workflows.get_namespaced_custom_object(*group, "workflows", name).get("status") or {}
    return status if status.get("phase") else None


def tally_params(tmp_path: Path, **over) -> dict:
    from tests.models import tally
    from tests.models.witness import TALLY_MODEL

    tally.write_csv(str(tmp_path / "tally.csv"))
    return {
        "source-uri": str(tmp_path / "tally.csv"),
        "model-def": TALLY_MODEL,
        "label": "label",
        "epochs": str(EPOCHS),
        "minibatch-size": "32",
        "records-per-task": "128",
        "max-workers": "2",
        "num-ps": "2",
        "worker-cpu": "",
        "worker-memory": "",
        "metric": "loss",
        "threshold": "-0.5",
        "publish-uri": str(tmp_path / "published"),
        **over,
    }


def step_pods(core, namespace: str, workflow: str, task: str) -> list:
    """The pods Argo ran for ``task`` of ``workflow`` (one per attempt), oldest first."""
    pods = core.list_namespaced_pod(namespace, label_selector=f"workflows.argoproj.io/workflow={workflow}").items
    pods = [p for p in pods if _task((p.metadata.annotations or {}).get("workflows.argoproj.io/node-name", "")) == task]
    return sorted(pods, key=lambda p: p.metadata.creation_timestamp)


def job_pods(core, namespace: str) -> list:
    return core.list_namespaced_pod(namespace, label_selector="elastic-step/job").items


_PROGRESS = re.compile(r"progress: epoch \d+/\d+ +[\d.]+% (\d+)/(\d+) records")


def records_trained(control_plane, namespace: str, pod: str) -> tuple[int, int]:
    """(records trained, records the job will train), as the master in ``pod`` reports them in its
    progress lines (every 5 s); (0, 0) before the first."""
    for kubelet in control_plane.nodes.values():
        path = kubelet.log_path(namespace, pod, "main")
        if path is not None and path.exists():
            hits = _PROGRESS.findall(path.read_text(errors="replace"))
            return (int(hits[-1][0]), int(hits[-1][1])) if hits else (0, 0)
    return 0, 0


class TrainingStep:
    """The training step of `workflow`: its latest attempt's pod, and the master's progress there."""

    def __init__(self, control_plane, core, namespace: str, workflow: str):
        self.cp, self.core, self.namespace, self.workflow = control_plane, core, namespace, workflow

    def pod(self) -> str | None:
        pods = step_pods(self.core, self.namespace, self.workflow, "elastic-train")
        return pods[-1].metadata.name if pods else None

    def records(self) -> tuple[int, int]:
        pod = self.pod()
        return records_trained(self.cp, self.namespace, pod) if pod else (0, 0)

    def progress(self) -> float:
        done, total = self.records()
        return done / total if total else 0.0

    def wait_checkpoint_then(self, ckpt: Path, fraction: float, timeout: float) -> None:
        """Until a checkpoint is committed under `ckpt` and the step has trained `fraction` of its records."""
        wait_for(
            lambda: self.progress() >= fraction and list(ckpt.glob("*/checkpoint.json")),
            timeout,
            interval=0.5,
            what=f"a checkpoint, then {fraction:.0%} of the records",
        )


def test_the_shipped_template_trains_evaluates_and_publishes_on_argos_controller(
    control_plane, node, argo, workflows, pipeline_ns, s3_server, tmp_path
):
    """data prep -> elastic training (the master in the step's pod starts worker and PS pods through
    the Kubernetes backend; they read the step's local data from it) -> evaluation -> publishing,
    gated on it. Argo's controller decides every step; the published model's weights say that every
    record was applied exactly once."""
    from tests.models.witness import assert_each_record_applied_exactly, assert_exactly_once

    namespace = pipeline_ns
    params = tally_params(tmp_path)
    published = Path(params["publish-uri"])
    recorder = PodRecorder(client.CoreV1Api(control_plane.api_client()), namespace)
    t0 = time.monotonic()
    submit(workflows, namespace, "train-eval", params, template=shipped_template())
    done = finished(workflows, namespace, "train-eval", timeout=900)
    took = time.monotonic() - t0
    recorder.stop()
    assert_succeeded(done, control_plane, namespace, "train-eval")
    nodes = {n["displayName"]: n for n in done["status"]["nodes"].values()}
    for step in ("data-prep", "elastic-train", "evaluate", "publish"):
        assert nodes[step]["phase"] == "Succeeded", (step, nodes[step])
    # The master ran in the step's pod and started the job's pods, owned by that pod, through the API.
    ours = {n: o for n, o in recorder.seen.items() if (o["metadata"].get("labels") or {}).get("elastic-step/job")}
    assert {o["metadata"]["labels"]["elastic-step/role"] for o in ours.values()} == {"worker", "ps"}, sorted(ours)
    owners = {(r["kind"], r["name"], r["uid"]) for o in ours.values() for r in o["metadata"]["ownerReferences"]}
    assert len(owners) == 1, owners
    kind, name, uid = owners.pop()
    step = client.CoreV1Api(control_plane.api_client()).read_namespaced_pod(name, namespace)
    assert kind == "Pod" and step.metadata.uid == uid
    assert step.metadata.labels["workflows.argoproj.io/workflow"] == "train-eval"
    assert _task(step.metadata.annotations["workflows.argoproj.io/node-name"]) == "elastic-train"
    train_log = pod_logs(control_plane, namespace, "train-eval", "elastic-train", tail=10**6)
    assert "backend auto -> kubernetes" in train_log and "read it from the master" in train_log, train_log[-5000:]
    # Published where the parameters say, and the weights count each record exactly once per epoch.
    summary = json.loads((published / "summary.json").read_text())
    assert summary["backend"] == "kubernetes" and summary["epochs"] == EPOCHS
    assert_exactly_once(summary)
    prepared = s3_artifact(s3_server, "artifacts", nodes["data-prep"], "prepared", tmp_path / "prepared")
    assert_each_record_applied_exactly(published, {"train": str(prepared / "prepared" / "train")}, EPOCHS)
    submitted = _time(done["metadata"]["creationTimestamp"])
    first_step = _time(nodes["elastic-train"]["startedAt"]) + summary["startup_seconds"]
    steps = ", ".join(
        f"{n} {_time(nodes[n]['finishedAt']) - _time(nodes[n]['startedAt']):.0f}s"
        for n in ("data-prep", "elastic-train", "evaluate", "publish")
    )
    print(
        f"\nshipped template on Argo: submission -> first committed training step {first_step - submitted:.0f}s "
        f"(data prep, the training pod, its PS and workers); training {summary['training_seconds']:.1f}s; "
        f"whole run {took:.0f}s; steps as Argo timed them: {steps}"
    )


# ------------------------------------------------------------------------ preemption, a killed step, retry

POOL_LABEL = "elastic-step-test/argo-pool"
POOL_TAINT = {"key": "elastic-step-test/argo-pool", "value": "yes", "effect": "NoSchedule"}


@pytest.fixture(scope="module")
def argo_pool(control_plane, argo, node):
    """A node with room for the training step's pod (1 cpu) and two 1-cpu workers, and nothing else
    that requests cpu: a higher-priority pod can only be placed by preempting a worker."""
    pool = control_plane.add_node(
        "argo-pool", cpu="3", memory="16Gi", pods=30, labels={POOL_LABEL: "yes"}, taints=[POOL_TAINT]
    )
    pool.images.update(node.images)
    return pool


def test_a_preempted_worker_and_a_killed_training_pod_cost_the_workflow_nothing(
    control_plane, argo, argo_pool, workflows, pipeline_ns, s3_server, tmp_path
):
    """In the workflow's training step, on progress: a higher-priority pod makes the real scheduler
    preempt a worker (the job trains on, and the relaunched worker joins when room is back); then the
    step's pod is deleted at once (grace 0, as when a node is lost). Argo retries the step under the
    shipped retry policy, the retried master resumes the job from its checkpoint, and the workflow
    succeeds with every record applied exactly once in the published model."""

    namespace, core = pipeline_ns, client.CoreV1Api(control_plane.api_client())
    epochs = 80  # ~40 s of training: the master's progress lines (every 5 s) see each stage of it
    ckpt = tmp_path / "checkpoints"  # every pod of this one-machine cluster sees it, as it would a bucket
    params = tally_params(
        tmp_path,
        **{
            "epochs": str(epochs),
            "worker-cpu": "1",
            "checkpoint-uri": str(ckpt),
            "checkpoint-every": "20000",
            "backend": "kubernetes",
        },
    )
    # The workflow's pods and, through the master's pod spec, the job's pods go to the pool: how a
    # platform team steers a workflow's placement (README: "Placement").
    placement = {"nodeSelector": {POOL_LABEL: "yes"}, "tolerations": [{**POOL_TAINT, "operator": "Equal"}]}
    patch = {
        "containers": [{"name": "main", "env": [{"name": "ELASTIC_STEP_POD_SPEC", "value": json.dumps(placement)}]}]
    }
    submit(
        workflows, namespace, "chaos", params, template=shipped_template(), podSpecPatch=json.dumps(patch), **placement
    )

    step = TrainingStep(control_plane, core, namespace, "chaos")
    master_pod, progress = step.pod, step.progress

    def records() -> int:
        return step.records()[0]

    def workers(phase: str = "Running") -> list:
        return [
            p
            for p in job_pods(core, namespace)
            if p.metadata.labels["elastic-step/role"] == "worker"
            and p.status.phase == phase
            and not p.metadata.deletion_timestamp
        ]

    try:
        # 1. Preemption, at 15 % of the records.
        wait_for(
            lambda: progress() >= 0.15 and len(workers()) == 2, 300, interval=0.5, what="two workers training past 15 %"
        )
        first = {p.metadata.name for p in workers()}
        # The training step's master answers its liveness probe's request, on the pod's IP and the probe's port
        # (the kubelet probes it too: test_a_frozen_training_step_is_restarted_by_its_liveness_probe).
        probe = shipped_template_probe()
        ip = core.read_namespaced_pod(master_pod(), namespace).status.pod_ip
        with urllib.request.urlopen(f"http://{ip}:{probe['port']}{probe['path']}", timeout=10) as answer:
            assert answer.status == 200, answer.read()
        core.create_namespaced_pod(namespace, intruder_pod(placement, ["sleep", "600"]))
        wait_for(
            lambda: core.read_namespaced_pod("intruder", namespace).status.phase == "Running",
            120,
            what="the intruder placed by preempting a worker",
        )
        preempted = first - {p.metadata.name for p in workers()}
        assert len(preempted) == 1, (first, [p.metadata.name for p in workers()])
        at = records()
        wait_for(lambda: records() > at + 1000, 120, what="training on with one worker")
        pending = workers("Pending")
        assert len(pending) == 1 and pending[0].spec.node_name is None, [p.metadata.name for p in pending]
        core.delete_namespaced_pod("intruder", namespace, grace_period_seconds=0)
        wait_for(lambda: len(workers()) == 2, 180, what="the relaunched worker running")
        # 2. The training step's pod deleted at once, after a checkpoint and at 55 % of the records.
        step.wait_checkpoint_then(ckpt, 0.55, 300)
        killed = master_pod()
        killed_at = records()
        core.delete_namespaced_pod(killed, namespace, grace_period_seconds=0)
        wait_for(
            lambda: (
                f"{namespace}/{killed}" not in argo_pool.running()
                and killed not in {p.metadata.name for p in core.list_namespaced_pod(namespace).items}
            ),
            120,
            what="the killed step's master exited and its pod gone",
        )
        # The last checkpoint the killed master committed (it may have cut one after its last progress
        # line): the one the retry must resume from.
        (last_before_kill,) = (json.loads(m.read_text()) for m in ckpt.glob("*/checkpoint.json"))
        done = finished(workflows, namespace, "chaos", timeout=900)
    except Exception:
        print(pod_logs(control_plane, namespace, "chaos", "elastic-train", tail=6000))
        raise
    assert_succeeded(done, control_plane, namespace, "chaos")
    attempts = [
        n for n in done["status"]["nodes"].values() if n["type"] == "Pod" and _task(n["name"]) == "elastic-train"
    ]
    assert sorted(n["phase"] for n in attempts) == ["Error", "Succeeded"], [
        (n["name"], n["phase"], n.get("message")) for n in attempts
    ]
    retried = master_pod()
    assert retried != killed
    log = pod_logs(control_plane, namespace, "chaos", "elastic-train", tail=10**6)
    assert "resuming job" in log and "from checkpoint" in log, log[-4000:]
    restart = assert_resumed_exactly(last_before_kill, done, params, s3_server, tmp_path, epochs)
    assert job_pods(core, namespace) == []
    print(
        f"\nArgo chaos: {preempted.pop()} preempted at {at} records; step pod {killed} deleted at {killed_at}; "
        f"the retry resumed from the checkpoint at {restart['records_committed_at_checkpoint']}"
    )


def assert_resumed_exactly(checkpoint: dict, done: dict, params: dict, s3_server, tmp_path: Path, epochs: int) -> dict:
    """The retried step resumed once, from `checkpoint` (its manifest), and the published model applied every record
    exactly once per epoch (the audit exact, the ledger agreeing with it). The restart's record."""
    from tests.models.witness import assert_each_record_applied_exactly, assert_exactly_once

    published = Path(params["publish-uri"])
    summary = json.loads((published / "summary.json").read_text())
    (restart,) = summary["checkpoints"]["restarts"]
    assert restart["from_checkpoint"] == checkpoint["id"], (restart, checkpoint)
    assert 0 < restart["records_committed_at_checkpoint"] == checkpoint["records_committed"], (restart, checkpoint)
    assert_exactly_once(summary)
    prep = next(n for n in done["status"]["nodes"].values() if n["displayName"] == "data-prep")
    prepared = s3_artifact(s3_server, "artifacts", prep, "prepared", tmp_path / "prepared")
    assert_each_record_applied_exactly(published, {"train": str(prepared / "prepared" / "train")}, epochs)
    return restart


def pod_processes(kubelet, namespace: str, pod: str, match) -> set[int]:
    """The host PIDs of the processes of `pod` whose argv (a list of bytes) `match` accepts."""
    pids = set()
    for pid in kubelet.processes(namespace, pod):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if match(argv):
            pids.add(pid)
    return pids


def is_master(argv: list[bytes]) -> bool:
    """The training step's master: `elastic-step train` (Argo's emissary, which runs it, is not)."""
    return b"train" in argv and any(a.endswith((b"elastic-step", b"elastic_step.cli")) for a in argv)


def is_argo_wait(argv: list[bytes]) -> bool:
    return any(a.endswith(b"argoexec") for a in argv) and b"wait" in argv


def main_terminated(core, namespace: str, pod: str):
    """The `main` container's terminated state, once it has one."""
    for cs in core.read_namespaced_pod(pod, namespace).status.container_statuses or []:
        if cs.name == "main" and cs.state.terminated is not None:
            return cs.state.terminated
    return None


def test_a_frozen_training_step_is_restarted_by_its_liveness_probe(
    control_plane, node, argo, workflows, pipeline_ns, s3_server, tmp_path
):
    """The shipped template's training step, its master frozen (SIGSTOP) once it has trained past a checkpoint: alive
    to the API, silent to its probe. The kubelet's liveness probe fails, the kubelet kills the container (Unhealthy,
    then Killing), the pod fails under its restartPolicy Never, Argo retries the step under the shipped retry policy,
    and the retried master resumes from the checkpoint: every record applied exactly once in the published model."""

    namespace, core = pipeline_ns, client.CoreV1Api(control_plane.api_client())
    epochs = 80
    ckpt = tmp_path / "checkpoints"
    params = tally_params(
        tmp_path,
        **{"epochs": str(epochs), "checkpoint-uri": str(ckpt), "checkpoint-every": "20000", "backend": "kubernetes"},
    )
    submit(workflows, namespace, "frozen", params, template=shipped_template())

    step = TrainingStep(control_plane, core, namespace, "frozen")
    try:
        step.wait_checkpoint_then(ckpt, 0.35, 400)  # on progress, never on time
        frozen = step.pod()
        pids = pod_processes(node, namespace, frozen, is_master)
        assert pids, f"no master process found in pod {frozen}: the freeze did not fire"
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: all(stopped(p) for p in pids), 30, interval=0.05, what=f"the master {sorted(pids)} stopped")
        (frozen_at,) = (json.loads(m.read_text()) for m in ckpt.glob("*/checkpoint.json"))
        # The probe (every 15 s, 4 failures) kills it; the pod's grace (30 s) passes unheard by a stopped process.
        killed = wait_for(
            lambda: main_terminated(core, namespace, frozen), 300, interval=1, what=f"{frozen}'s main killed"
        )
        assert killed.exit_code == 137, killed  # SIGKILL, after the grace period
        # Argo's controller then stops the pod's wait container through pods/exec, which the process kubelet does
        # not serve ("error dialing backend" in its log): the test sends that SIGTERM as the controller's exec would.
        for pid in pod_processes(node, namespace, frozen, is_argo_wait):
            os.kill(pid, signal.SIGTERM)
        wait_for(
            lambda: read_phase(core, namespace, frozen) in ("Failed", None),
            120,
            interval=1,
            what=f"the frozen step's pod {frozen} failed",
        )
        done = finished(workflows, namespace, "frozen", timeout=900)
    except Exception:
        print(pod_logs(control_plane, namespace, "frozen", "elastic-train", tail=6000))
        raise
    assert_succeeded(done, control_plane, namespace, "frozen")
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={frozen}").items
    said = [(e.reason, e.message) for e in events]
    assert any(r == "Unhealthy" and m.startswith("Liveness probe failed") for r, m in said), said
    assert ("Killing", "Container main failed liveness probe, will be restarted") in said, said
    attempts = [
        n for n in done["status"]["nodes"].values() if n["type"] == "Pod" and _task(n["name"]) == "elastic-train"
    ]
    assert sorted(n["phase"] for n in attempts) in (["Error", "Succeeded"], ["Failed", "Succeeded"]), [
        (n["name"], n["phase"], n.get("message")) for n in attempts
    ]
    assert step.pod() != frozen
    assert_resumed_exactly(frozen_at, done, params, s3_server, tmp_path, epochs)
    assert job_pods(core, namespace) == []
    print(
        f"\nArgo liveness: step pod {frozen} frozen after checkpoint {frozen_at['id']} "
        f"({frozen_at['records_committed']} records), killed by its probe, resumed from it"
    )


def read_phase(core, namespace: str, name: str) -> str | None:
    """The pod's phase; None once it is gone."""
    try:
        return core.read_namespaced_pod(name, namespace).status.phase
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


def test_deleting_the_workflow_removes_every_pod_of_the_job(control_plane, argo, workflows, pipeline_ns, tmp_path):
    """Argo's pods are owned by the Workflow, the job's pods by the training step's pod: deleting the
    workflow lets the garbage collector remove them all."""
    namespace, core = pipeline_ns, client.CoreV1Api(control_plane.api_client())
    submit(workflows, namespace, "doomed", tally_params(tmp_path, epochs="200"), template=shipped_template())
    try:
        wait_for(
            lambda: len([p for p in job_pods(core, namespace) if p.status.phase == "Running"]) >= 3,
            300,
            interval=0.5,
            what="the job's PS and workers running",
        )
    except AssertionError:  # once in a full cold run: what the workflow and its pods were doing
        wf = workflows.get_namespaced_custom_object("argoproj.io", "v1alpha1", namespace, "workflows", "doomed")
        print(
            {k: wf.get("status", {}).get(k) for k in ("phase", "message")},
            [(p.metadata.name, p.status.phase, p.spec.node_name) for p in core.list_namespaced_pod(namespace).items],
        )
        print(pod_logs(control_plane, namespace, "doomed", tail=6000))
        raise
    wf_uid = workflows.get_namespaced_custom_object("argoproj.io", "v1alpha1", namespace, "workflows", "doomed")[
        "metadata"
    ]["uid"]
    (step,) = step_pods(core, namespace, "doomed", "elastic-train")
    assert [(r.kind, r.uid) for r in step.metadata.owner_references] == [("Workflow", wf_uid)]
    for p in job_pods(core, namespace):
        assert [(r.kind, r.uid) for r in p.metadata.owner_references] == [("Pod", step.metadata.uid)]
    workflows.delete_namespaced_custom_object("argoproj.io", "v1alpha1", namespace, "workflows", "doomed")
    wait_for(
        lambda: not core.list_namespaced_pod(namespace).items,
        120,
        interval=0.5,
        what="every pod of the deleted workflow gone",
    )


# ------------------------------------------------------------------------------ scheduled retraining


def test_the_cron_workflow_fires_twice_each_run_publishes_and_forbid_holds(
    control_plane, argo, workflows, pipeline_ns, tmp_path
):
    """The shipped CronWorkflow on a short test schedule: each run is the whole pipeline and publishes a
    model; a run lasts longer than the interval, and with `concurrencyPolicy: Forbid` the next run
    waits for it (the ticks in between are skipped), as Argo's own records of the runs show."""
    namespace = pipeline_ns
    interval = 15
    workflows.create_namespaced_custom_object(
        "argoproj.io", "v1alpha1", namespace, "workflowtemplates", shipped_template()
    )
    cron = yaml.safe_load(CRON.read_text())
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    cron["spec"]["schedules"] = [f"@every {interval}s"]
    params = tally_params(tmp_path, **{"epochs": "1", "backend": "local", "max-workers": "1", "num-ps": "1"})
    cron["spec"]["workflowSpec"]["arguments"]["parameters"] = [{"name": k, "value": v} for k, v in params.items()]
    workflows.create_namespaced_custom_object("argoproj.io", "v1alpha1", namespace, "cronworkflows", cron)
    published = Path(params["publish-uri"]) / "summary.json"
    runs, overlaps, jobs_published = {}, [], []
    label = f"workflows.argoproj.io/cron-workflow={cron['metadata']['name']}"

    def two_runs_done() -> bool:
        items = workflows.list_namespaced_custom_object(
            "argoproj.io", "v1alpha1", namespace, "workflows", label_selector=label
        )["items"]
        for wf in items:
            runs[wf["metadata"]["name"]] = wf
        live = [
            wf["metadata"]["name"]
            for wf in items
            if (wf.get("status") or {}).get("phase") in (None, "", "Pending", "Running")
        ]
        if len(live) > 1:
            overlaps.append(live)
        if published.exists():
            job = json.loads(published.read_text())["job_id"]
            if not jobs_published or jobs_published[-1] != job:
                jobs_published.append(job)
        return sum((wf.get("status") or {}).get("phase") in ("Succeeded", "Failed", "Error") for wf in items) >= 2

    try:
        wait_for(two_runs_done, 600, interval=0.5, what="two runs of the CronWorkflow")
    finally:
        workflows.patch_namespaced_custom_object(
            "argoproj.io", "v1alpha1", namespace, "cronworkflows", cron["metadata"]["name"], {"spec": {"suspend": True}}
        )
    assert not overlaps, overlaps
    first, second = sorted(runs.values(), key=lambda wf: wf["metadata"]["creationTimestamp"])[:2]
    for wf in (first, second):
        assert_succeeded(wf, control_plane, namespace, wf["metadata"]["name"])
        publish = [n for n in wf["status"]["nodes"].values() if n["displayName"] == "publish"]
        assert [n["phase"] for n in publish] == ["Succeeded"], wf["metadata"]["name"]
    # Each run's model was published (its job id is its workflow's uid), the second after the first.
    assert jobs_published[-2:] == [f"{wf['metadata']['uid']}-elastic-train" for wf in (first, second)], jobs_published
    # The first run outlasted the interval, so at least one tick fell while it ran: Forbid skipped it.
    scheduled = [_time(wf["metadata"]["annotations"]["workflows.argoproj.io/scheduled-time"]) for wf in (first, second)]
    first_ran = _time(first["status"]["finishedAt"]) - _time(first["status"]["startedAt"])
    assert first_ran > interval, first_ran
    assert scheduled[1] - scheduled[0] >= 2 * interval - 1, scheduled
    assert _time(second["status"]["startedAt"]) >= _time(first["status"]["finishedAt"])
    print(
        f"\ncron: runs scheduled {scheduled[1] - scheduled[0]:.0f}s apart at an interval of {interval}s; "
        f"the first ran {first_ran:.0f}s"
    )


# ------------------------------------------------------------------------------ runs that cannot start


def test_a_run_that_cannot_start_names_the_cause_in_the_workflows_status(
    control_plane, argo, workflows, pipeline_ns, tmp_path
):
    """A missing PriorityClass, a service account without the Role, a model file that is not there:
    each training step fails at once (exit 2, not retried), and the failed step's message in the
    workflow's status names the cause and the fix."""
    from kubernetes import utils

    namespace = pipeline_ns
    api = control_plane.api_client()
    # `no-pods`: may report step outputs (Argo's executor), may not run the job's pods.
    utils.create_from_dict(
        api, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "no-pods"}}, namespace=namespace
    )
    utils.create_from_dict(
        api,
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "no-pods-executor"},
            "subjects": [{"kind": "ServiceAccount", "name": "no-pods", "namespace": namespace}],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "elastic-step-argo-executor"},
        },
        namespace=namespace,
    )
    missing_model = str(tmp_path / "models" / "model.py")
    cases = {
        "no-priority-class": (
            {"backend": "kubernetes", "worker-priority-class": "gold-nonexistent"},
            {},
            ["gold-nonexistent", "PriorityClass"],
        ),
        "no-rbac": ({"backend": "kubernetes"}, {"serviceAccountName": "no-pods"}, ["pods", "role.yaml"]),
        "bad-model-def": ({"model-def": missing_model}, {}, [missing_model]),
    }
    for i, (name, (over, spec, _)) in enumerate(cases.items()):
        submit(
            workflows,
            namespace,
            name,
            tally_params(tmp_path, **over),
            template=shipped_template() if i == 0 else None,
            **spec,
        )
    for name, (_, _, says) in cases.items():
        done = finished(workflows, namespace, name, timeout=300)
        assert done["status"]["phase"] == "Failed", (name, done["status"].get("message"))
        attempts = [
            n for n in done["status"]["nodes"].values() if n["type"] == "Pod" and _task(n["name"]) == "elastic-train"
        ]
        assert len(attempts) == 1, (name, "bad input is not retried", [n["name"] for n in attempts])
        message = attempts[0].get("message", "")
        assert all(s in message for s in says), (name, message)
        assert "elastic-step: error:" in message, (name, message)
        print(f"\n{name}: " + next(line for line in message.splitlines() if "elastic-step: error:" in line)[:400])


def _time(stamp: str) -> float:
    import datetime

    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
