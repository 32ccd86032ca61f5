"""Argo Workflows for tests, built from the Go module proxy by scripts/build-argo (once per version,
into ``${ELASTIC_STEP_CACHE:-~/.cache/elastic-step}/argo-<version>/bin``).

    from tests.infra.kube.harness.argo import ArgoController, lint

    lint(["pipelines/argo/train-eval-template.yaml"])   # Argo's offline, strict lint: (ok, its output)

    with ArgoController(control_plane) as argo:        # Argo's CRDs and RBAC installed, then its
        ...                                             # controller running as a local process

The controller runs outside any pod, with a token of its own service account (``argo/argo``) bound
to Argo's own ClusterRole, so RBAC applies to it as in a cluster. The pods it creates run on the
process kubelet: ``ArgoController.images`` maps the executor image to the built ``argoexec`` (give
it to ``add_node(images=...)``, or update a node's ``images``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from .pod import Image
from .process import KUBE, REPO, Service, popen, run_build, stop_process, wait_for

BUILD_SCRIPT = REPO / "scripts" / "build-argo"
VERSION = (KUBE / "argo" / "VERSION").read_text().strip()
EXECUTOR_IMAGE = f"quay.io/argoproj/argoexec:{VERSION}"
CONTROLLER_CONFIGMAP = "workflow-controller-configmap"


class ArgoBuildError(RuntimeError):
    pass


def build_argo(*cmds: str) -> Path:
    """The bin directory holding `cmds` (all of Argo's if none), built when missing."""
    return run_build(BUILD_SCRIPT, *cmds, override_env="ELASTIC_STEP_ARGO_BIN", error=ArgoBuildError)


def lint(files: list[str | Path]) -> tuple[bool, str]:
    """Argo's own lint of `files`, offline and strict (references resolved among them)."""
    proc = subprocess.run(
        [str(build_argo("argo-lint") / "argo-lint"), *map(str, files)], capture_output=True, text=True, timeout=120
    )
    return proc.returncode == 0, proc.stdout + proc.stderr


def manifests() -> Path:
    """Argo's own manifests, from the module source scripts/build-argo keeps beside the binaries."""
    path = build_argo("workflow-controller", "argoexec").parent / "src" / "manifests"
    if not path.is_dir():
        raise ArgoBuildError(f"Argo's manifests are missing at {path}; remove {path.parent.parent} and build again")
    return path


def install(control_plane, namespace: str = "argo", config: dict | None = None) -> None:
    """Argo's CRDs (the minimal ones its install.yaml ships), the controller's service account,
    ClusterRole and binding (its cluster-install RBAC, unchanged) and its ConfigMap (``config``:
    keys of the controller's configuration, each a YAML value). Idempotent."""
    from kubernetes import client

    api = control_plane.api_client()
    root = manifests()
    docs = [
        d
        for f in sorted((root / "base" / "crds" / "minimal").glob("argoproj.io_*.yaml"))
        for d in yaml.safe_load_all(f.read_text())
        if d
    ]
    rbac = root / "cluster-install" / "workflow-controller-rbac"
    for name in ("workflow-controller-clusterrole.yaml", "workflow-controller-clusterrolebinding.yaml"):
        for d in yaml.safe_load_all((rbac / name).read_text()):
            if d:
                for s in d.get("subjects") or []:
                    s["namespace"] = namespace
                docs.append(d)
    _create(api, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    _create(api, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "argo", "namespace": namespace}})
    for d in docs:
        _create(api, d)
    ext = client.ApiextensionsV1Api(api)
    for d in docs:
        if d["kind"] == "CustomResourceDefinition":
            wait_for(
                lambda n=d["metadata"]["name"]: any(
                    c.type == "Established" and c.status == "True"
                    for c in ext.read_custom_resource_definition(n).status.conditions or []
                ),
                60,
                what=f"CRD {d['metadata']['name']} established",
            )
    data = {k: yaml.safe_dump(v) for k, v in {"metricsConfig": {"enabled": False}, **(config or {})}.items()}
    core = client.CoreV1Api(api)
    body = {"metadata": {"name": CONTROLLER_CONFIGMAP, "namespace": namespace}, "data": data}
    try:
        core.create_namespaced_config_map(namespace, body)
    except client.ApiException as e:
        if e.status != 409:
            raise
        core.replace_namespaced_config_map(CONTROLLER_CONFIGMAP, namespace, body)


def _create(api, doc: dict) -> None:
    from kubernetes import utils

    try:
        utils.create_from_dict(api, doc)
    except utils.FailToCreateError as e:
        if not all(getattr(x, "status", None) == 409 for x in e.api_exceptions):
            raise


class ArgoController(Service):
    """Argo's workflow-controller as a local process against ``control_plane``, after ``install``."""

    def __init__(self, control_plane, namespace: str = "argo", config: dict | None = None):
        self.cp, self.namespace, self.config = control_plane, namespace, config
        self.bin = build_argo("workflow-controller", "argoexec")
        # Its files too: the wait container mounts an emptyDir on /tmp, which hides a cache under /tmp.
        self.images = {EXECUTOR_IMAGE.rsplit(":", 1)[0]: Image((self.bin,), (self.bin,))}
        self.log_path = control_plane.workdir / "argo-controller.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> ArgoController:
        install(self.cp, self.namespace, self.config)
        token = self.cp.service_account_token(self.namespace, "argo", seconds=24 * 3600)
        kubeconfig = self.cp.kubeconfig_for(token, user="argo-controller")
        env = dict(os.environ, LEADER_ELECTION_DISABLE="true")
        self.proc = popen(
            [
                str(self.bin / "workflow-controller"),
                "--kubeconfig",
                str(kubeconfig),
                "--namespace",
                self.namespace,
                "--executor-image",
                EXECUTOR_IMAGE,
                "--executor-image-pull-policy",
                "IfNotPresent",
                "--loglevel",
                "info",
            ],
            log_path=self.log_path,
            env=env,
        )
        wait_for(
            lambda: self.proc.poll() is not None or "Starting Workflow Controller" in self.log(),
            60,
            what="Argo's workflow-controller to start",
        )
        if self.proc.poll() is not None:
            raise ArgoBuildError(f"workflow-controller exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
