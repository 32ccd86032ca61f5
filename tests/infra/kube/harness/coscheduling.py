"""Gang scheduling for the bench: the Coscheduling plugin of sigs.k8s.io/scheduler-plugins, built from
the Go module proxy by scripts/build-scheduler-plugins (once per version, tests/infra/kube/scheduler-plugins/VERSION,
into ``${ELASTIC_STEP_CACHE:-~/.cache/elastic-step}/scheduler-plugins-<version>/bin``). Bench only: the
tests do not use it.

    from tests.infra.kube.harness.coscheduling import GangScheduler, pod_group

    with GangScheduler(control_plane) as gang:       # CRDs installed, then the scheduler and controller running
        custom.create_namespaced_custom_object(*gang.PODGROUPS, "ns", pod_group("job-a", min_member=4))
        # pods: spec.schedulerName = gang.name, label scheduling.x-k8s.io/pod-group: job-a

The scheduler is scheduler-plugins' own kube-scheduler build (the in-tree plugins plus the out-of-tree
ones) running beside the control plane's kube-scheduler as a second scheduler: one profile,
``schedulerName`` ``gang-scheduler`` by default, with Coscheduling enabled at every extension point it
implements (queueSort, preFilter, postFilter, permit, reserve, postBind: ``multiPoint``, as its
README configures it), the default plugins (DefaultPreemption among them) kept. Pods name it in
``spec.schedulerName``; pods that do not are left to kube-scheduler. A PodGroup (``minMember``) with the
label ``scheduling.x-k8s.io/pod-group`` on its pods gives all-or-nothing placement: a pod waits at
Permit until ``minMember`` of its group are assumed, and a group that cannot fit is rejected whole (its
waiting pods release their nodes) and backed off.

Coscheduling at v0.34 reads only the PodGroup's spec (minMember, minResources, scheduleTimeoutSeconds)
and counts the group's pods itself, but scheduler-plugins' controller (PodGroup status) is still
needed: Kubernetes 1.34's scheduler requeues a pod only on the cluster events its rejecting plugins
registered (queueing hints, locked on), and Coscheduling registers Pod/Add and PodGroup/Add|Update
only. A group rejected while another holds the room (PreFilter "failed recently", PostFilter) is
therefore retried only when some PodGroup changes, which the controller does whenever a group's pods
change phase or go away, or at the queue's 5-minute flush. Without it, a waiting job started up to 5
minutes after the room freed. Both run as local processes with the admin kubeconfig, as the harness's
kube-scheduler does; the controller's metrics are off and its probe on loopback.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from .process import KUBE, REPO, Service, free_port, http_ok, popen, run_build, stop_process, wait_for

BUILD_SCRIPT = REPO / "scripts" / "build-scheduler-plugins"
VERSION = (KUBE / "scheduler-plugins" / "VERSION").read_text().strip()
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
PODGROUPS = ("scheduling.x-k8s.io", "v1alpha1")  # group, version; plural "podgroups"


class SchedulerPluginsBuildError(RuntimeError):
    pass


def build_scheduler_plugins(*cmds: str) -> Path:
    """The bin directory holding `cmds` (the scheduler if none), built when missing."""
    return run_build(
        BUILD_SCRIPT, *cmds, override_env="ELASTIC_STEP_SCHEDULER_PLUGINS_BIN", error=SchedulerPluginsBuildError
    )


def pod_group(name: str, min_member: int, *, schedule_timeout_s: int | None = None) -> dict:
    """A PodGroup: its pods are placed all together (at least `min_member` of them) or not at all."""
    spec: dict = {"minMember": int(min_member)}
    if schedule_timeout_s is not None:
        spec["scheduleTimeoutSeconds"] = int(schedule_timeout_s)
    return {"apiVersion": "/".join(PODGROUPS), "kind": "PodGroup", "metadata": {"name": name}, "spec": spec}


CRDS = (
    "coscheduling/crd.yaml",  # PodGroup
    "capacityscheduling/crd.yaml",
)  # ElasticQuota: the controller watches it too


def install_crds(control_plane) -> None:
    """The PodGroup and ElasticQuota CRDs from the module's own manifests. Idempotent."""
    from kubernetes import client

    ext = client.ApiextensionsV1Api(control_plane.api_client())
    manifests = build_scheduler_plugins().parent / "manifests"
    docs = []
    for name in CRDS:
        if not (manifests / name).is_file():
            raise SchedulerPluginsBuildError(
                f"{manifests / name} is missing; remove {manifests.parent} and build again"
            )
        docs += list(yaml.safe_load_all((manifests / name).read_text()))
    for doc in docs:
        if not doc or doc.get("kind") != "CustomResourceDefinition":
            continue
        try:
            ext.create_custom_resource_definition(doc)
        except client.ApiException as e:
            if e.status != 409:
                raise
        name = doc["metadata"]["name"]
        wait_for(
            lambda: any(
                c.type == "Established" and c.status == "True"
                for c in ext.read_custom_resource_definition(name).status.conditions or []
            ),
            60,
            what=f"CRD {name} established",
        )


def scheduler_config(kubeconfig: Path, name: str, *, permit_wait_s: int, backoff_s: int) -> dict:
    """The KubeSchedulerConfiguration of the second scheduler: one profile with Coscheduling."""
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "leaderElection": {"leaderElect": False},
        "clientConnection": {"kubeconfig": str(kubeconfig), "qps": 100, "burst": 200},
        "profiles": [
            {
                "schedulerName": name,
                "plugins": {
                    "multiPoint": {"enabled": [{"name": "Coscheduling"}]},
                    "queueSort": {"enabled": [{"name": "Coscheduling"}], "disabled": [{"name": "*"}]},
                },
                "pluginConfig": [
                    {
                        "name": "Coscheduling",
                        "args": {"permitWaitingTimeSeconds": permit_wait_s, "podGroupBackoffSeconds": backoff_s},
                    }
                ],
            }
        ],
    }


class GangScheduler(Service):
    """scheduler-plugins' scheduler (Coscheduling) as a local process against ``control_plane``."""

    def __init__(
        self,
        control_plane,
        name: str = "gang-scheduler",
        *,
        permit_wait_s: int = 10,
        backoff_s: int = 0,
        verbosity: int = 2,
        controller: bool = True,
        unschedulable_max_s: int = 10,
    ):
        self.cp, self.name = control_plane, name
        self.unschedulable_max_s = unschedulable_max_s
        self.permit_wait_s, self.backoff_s, self.verbosity = permit_wait_s, backoff_s, verbosity
        self.bin = build_scheduler_plugins("scheduler", *(("controller",) if controller else ()))
        self.with_controller = controller
        self.log_path = control_plane.workdir / "logs" / f"{name}.log"
        self.controller_log_path = control_plane.workdir / "logs" / f"{name}-controller.log"
        self.proc: subprocess.Popen | None = None
        self.controller: subprocess.Popen | None = None

    def start(self) -> GangScheduler:
        install_crds(self.cp)
        if self.with_controller:
            probe = free_port()
            self.controller = popen(
                [
                    str(self.bin / "controller"),
                    "--metricsAddr=0",
                    f"--probeAddr=127.0.0.1:{probe}",
                    "--qps=50",
                    "--burst=100",
                    "--workers=2",
                ],
                log_path=self.controller_log_path,
                env=dict(os.environ, KUBECONFIG=str(self.cp.kubeconfig_path)),
            )
            try:
                wait_for(
                    lambda: self.controller.poll() is not None or http_ok(f"http://127.0.0.1:{probe}/healthz"),
                    60,
                    what="scheduler-plugins' controller healthy",
                )
            except AssertionError:
                self.stop()
                raise
            if self.controller.poll() is not None:
                raise SchedulerPluginsBuildError(
                    f"the controller exited with {self.controller.returncode}:\n"
                    f"{self.log(self.controller_log_path)[-3000:]}"
                )
        cfg = self.cp.workdir / f"{self.name}.yaml"
        cfg.write_text(
            yaml.safe_dump(
                scheduler_config(
                    self.cp.kubeconfig_path, self.name, permit_wait_s=self.permit_wait_s, backoff_s=self.backoff_s
                )
            )
        )
        port = free_port()
        kc = str(self.cp.kubeconfig_path)
        self.proc = popen(
            [
                str(self.bin / "scheduler"),
                f"--config={cfg}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.cp.workdir / self.name}",
                f"--v={self.verbosity}",
                # a group still missed a requeue in about 1 of 6 self-checks (see above): it
                # then waits for the queue's flush of old unschedulable pods (every 30 s), not 5 min
                f"--pod-max-in-unschedulable-pods-duration={self.unschedulable_max_s}s",
            ],
            log_path=self.log_path,
        )
        wait_for(
            lambda: self.proc.poll() is not None or http_ok(f"https://127.0.0.1:{port}/healthz", insecure=True),
            60,
            what=f"{self.name} healthy",
        )
        if self.proc.poll() is not None:
            self.stop()
            raise SchedulerPluginsBuildError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
        return self

    def stop(self) -> None:
        for attr in ("proc", "controller"):
            proc = getattr(self, attr)
            if proc is not None:
                stop_process(proc)
                setattr(self, attr, None)

    def log(self, path: Path | None = None) -> str:
        path = path or self.log_path
        return path.read_text(errors="replace") if path.exists() else ""


def _self_check() -> None:
    """`python -m tests.infra.kube.harness.coscheduling`: all-or-nothing placement on a real control plane. Group a
    (3 pods of 1 cpu) fills 3 of 4 cpus; group b (3 pods) must then place none, and all 3 once a is gone."""
    import time

    from kubernetes import client

    from .controlplane import ControlPlane

    def pod(name: str, group: str) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {POD_GROUP_LABEL: group}},
            "spec": {
                "schedulerName": "gang-scheduler",
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {
                        "name": "c",
                        "image": "none",
                        "command": ["sleep", "1000"],
                        "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "1"}},
                    }
                ],
            },
        }

    def bound(prefix: str) -> int:
        return sum(
            bool(p.spec.node_name) for p in core.list_namespaced_pod("t").items if p.metadata.name.startswith(prefix)
        )

    with ControlPlane() as cp, GangScheduler(cp) as gang:
        cp.add_node("n", cpu="4", memory="8Gi", pods=20)
        cp.create_namespace("t")
        api = cp.api_client()
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        for g in "ab":
            custom.create_namespaced_custom_object(*PODGROUPS, "t", "podgroups", pod_group(g, 3))
        for i in range(3):
            core.create_namespaced_pod("t", pod(f"a-{i}", "a"))
        wait_for(lambda: bound("a-") == 3, 30, what="group a placed")
        for i in range(3):
            core.create_namespaced_pod("t", pod(f"b-{i}", "b"))
        time.sleep(5)
        assert bound("b-") == 0, f"group b placed {bound('b-')} of 3 pods with room for 1"
        t = time.monotonic()
        for i in range(3):
            core.delete_namespaced_pod(f"a-{i}", "t", grace_period_seconds=0)
        try:
            wait_for(lambda: bound("b-") == 3, 60, what="group b placed once a is gone")
        except AssertionError:
            print(gang.log()[-8000:], gang.log(gang.controller_log_path)[-4000:], sep="\n")
            raise
        print(f"ok: group b waited whole with room for 1 of 3, placed {time.monotonic() - t:.1f}s after a went")


if __name__ == "__main__":
    _self_check()
