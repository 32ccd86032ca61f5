"""The pod settings dress the job's pods on the real control plane: a backend made from a TrainConfig (as the master
makes it) whose settings come from the parameters and from a KFP TaskConfig exactly as KFP's driver injects it; the
pods it creates, read back from the apiserver, carry each role's resources (a GPU in the workers' limits),
tolerations, node selector, affinity, env, Secrets, volumes and service account. The pods need a GPU, a PVC and a
node label no harness node has: they stay Pending, which is fine here (the spec is what is checked)."""

from __future__ import annotations

import pytest

from elastic_step.backends.api import InstanceId, InstanceSpec
from elastic_step.backends.kubernetes import KubernetesBackend, Owner
from elastic_step.backends.kubernetes.settings import SPOT_AUTO, from_task_config
from elastic_step.errors import ConfigError
from elastic_step.master.api import TrainConfig
from tests.infra.kube.harness import wait_for
from tests.kubernetes.jobs import WORKER_IMAGE
from tests.kubernetes.test_backend import (  # noqa: F401
    SLEEPER,
    STEP_IMAGE,
    job_pods,
    sa_kubeconfig,
    secret_exists,
    sleeper_pod,
)
from tests.unit.backends.test_k8s_settings import INJECTED, task_config

pytestmark = pytest.mark.kubernetes

GPU = "nvidia.com/gpu"


def test_the_parameters_and_the_task_config_dress_each_role_s_pods(
    control_plane, core, namespace, sa_kubeconfig, tmp_path
):
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "training"}})
    values = from_task_config(
        task_config(tmp_path, INJECTED),
        {
            "worker_memory": "2Gi",
            "ps_cpu": "500m",
            "ps_memory": "1Gi",
            "ps_tolerations": "core=yes:NoSchedule",
            "ps_node_selector": "pool=core",
            "job_service_account": "training",
            "env": "LOG=info",
            "env_from_secrets": "aws,DB_PASSWORD=db/password",
            "volumes": "emptydir:scratch:/scratch",
        },
    )
    cfg = TrainConfig(model_def="m.py", train_data="t", output="o", worker_image="sleeper", **values).validate()
    backend = KubernetesBackend.from_train_config(
        cfg, "dressed", "t", kubeconfig=str(sa_kubeconfig), namespace=namespace, owner=None
    )
    try:
        backend.start(InstanceSpec(InstanceId("worker", 0), SLEEPER, cpu=cfg.worker_cpu, memory=cfg.worker_memory))
        backend.start(InstanceSpec(InstanceId("ps", 0), SLEEPER, cpu=cfg.ps_cpu, memory=cfg.ps_memory))
        wait_for(lambda: len(job_pods(core, namespace, "dressed")) == 2, 30, what="the job's two pods")
        pods = {p.metadata.labels["elastic-step/role"]: p for p in job_pods(core, namespace, "dressed")}
    finally:
        backend.close()
    worker, ps = pods["worker"].spec, pods["ps"].spec
    wc, pc = worker.containers[0], ps.containers[0]

    # resources: the task's (limits) for the workers, GPU included; the ps_* parameters for the PS
    assert wc.resources.limits == {"cpu": "100m", "memory": "100Mi", GPU: "1"} == wc.resources.requests
    assert pc.resources.limits == {"cpu": "500m", "memory": "1Gi"} == pc.resources.requests
    # placement: the task's for the workers, with the spot defaults; the ps_* parameters for the PS
    tolerations = [(t.key, t.operator, t.value, t.effect, t.toleration_seconds) for t in worker.tolerations]
    assert ("example-key", "Exists", None, "NoExecute", 3600) in tolerations
    assert all((k, "Equal", v, "NoSchedule", None) in tolerations for k, v in SPOT_AUTO)
    ours = [(t.key, t.value, t.effect) for t in ps.tolerations if not t.key.startswith("node.kubernetes.io/")]
    assert ours == [("core", "yes", "NoSchedule")]  # (the apiserver adds its not-ready/unreachable defaults)
    assert (worker.node_selector, ps.node_selector) == ({"disktype": "ssd"}, {"pool": "core"})
    (term,) = worker.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
    assert [(e.key, e.operator, e.values) for e in term.match_expressions] == [("disktype", "In", ["ssd"])]
    preferred = worker.affinity.node_affinity.preferred_during_scheduling_ignored_during_execution
    assert {(e.key, e.operator) for p in preferred for e in p.preference.match_expressions} == {
        (k, "In") for k, _ in SPOT_AUTO
    }
    (avoid,) = ps.affinity.node_affinity.preferred_during_scheduling_ignored_during_execution
    assert {e.operator for e in avoid.preference.match_expressions} == {"NotIn"}
    # env, Secrets, volumes, service account: every pod
    for spec, c in ((worker, wc), (ps, pc)):
        env = {e.name: e for e in c.env}
        assert (env["LOG"].value, env["ENV1"].value) == ("info", "val1")
        assert (
            env["DB_PASSWORD"].value_from.secret_key_ref.name,
            env["DB_PASSWORD"].value_from.secret_key_ref.key,
        ) == (
            "db",
            "password",
        )
        assert env["ELASTIC_STEP_JOB_ID"].value == "dressed"
        assert [f.secret_ref.name for f in c.env_from] == ["aws"]
        volumes = {v.name: v for v in spec.volumes}
        assert volumes["emptydir-scratch"].empty_dir is not None
        assert volumes["v"].persistent_volume_claim.claim_name == "v"
        assert {(m.name, m.mount_path) for m in c.volume_mounts} >= {("emptydir-scratch", "/scratch"), ("v", "/data")}
        assert spec.service_account_name == "training" and spec.automount_service_account_token is False


def test_the_pods_run_the_step_s_image_and_gpu_pods_its_gpu_variant(
    control_plane, core, node, namespace, sa_kubeconfig, caplog
):
    """No worker_image: each role's image is read from the step's pod (its `main` container), the GPU variant for a
    role with accelerators; worker_image wins, with a warning when GPU pods get an image without the GPU suffix;
    outside a pod with no image given, a ConfigError names what to set, before the job's Secret or any pod exists."""
    owner = sleeper_pod(core, namespace, "step", image=STEP_IMAGE)

    def backend(job: str, own: bool = True, **values):
        cfg = TrainConfig(model_def="m.py", train_data="t", output="o", **values).validate()
        return KubernetesBackend.from_train_config(
            cfg,
            job,
            "t",
            kubeconfig=str(sa_kubeconfig),
            namespace=namespace,
            owner=Owner(owner.metadata.name, owner.metadata.uid) if own else None,
        )

    b = backend("step-image", worker_accelerators=f"{GPU}=1")
    b.close()
    assert b.images == {"worker": f"{STEP_IMAGE}-gpu", "ps": STEP_IMAGE}
    with caplog.at_level("WARNING", "elastic_step.backends.kubernetes"):
        b = backend("given-image", worker_accelerators=f"{GPU}=1", worker_image=WORKER_IMAGE)
        b.close()
    assert b.images == {"worker": WORKER_IMAGE, "ps": WORKER_IMAGE}
    assert "GPUs they hold sit idle, paid for" in caplog.text and f"{GPU}=1" in caplog.text, caplog.text
    with pytest.raises(ConfigError) as e:
        backend("no-image", own=False)
    assert "worker_image is not set and the master does not run in a pod" in str(e.value), e.value
    assert "--worker-image" in str(e.value)
    assert job_pods(core, namespace, "no-image") == [] and not secret_exists(core, namespace, "no-image-token")
