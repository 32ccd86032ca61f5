"""Configuration: the cluster's credentials and namespace, the pod that owns the job's pods, the
address the master listens at, and the pod spec fields and labels the environment adds to the pods."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import socket

from elastic_step.backends.api import ROLES
from elastic_step.backends.kubernetes.errors import KubernetesBackendError
from elastic_step.errors import ConfigError

POD_IP_ENV = "ELASTIC_STEP_POD_IP"
POD_SPEC_ENV = "ELASTIC_STEP_POD_SPEC"
POD_LABELS_ENV = "ELASTIC_STEP_POD_LABELS"
NAMESPACE_ENV = "ELASTIC_STEP_NAMESPACE"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
BACKEND_CONTAINER_FIELDS = ("image", "command", "args")  # a container's fields the backend alone sets


@dataclasses.dataclass(frozen=True)
class Owner:
    """The pod that owns the job's pods and Secret (deleting it deletes them)."""

    name: str
    uid: str

    def ref(self) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": self.name,
            "uid": self.uid,
            "controller": False,
            "blockOwnerDeletion": False,
        }

    @classmethod
    def from_env(cls, env=None) -> Owner | None:
        env = os.environ if env is None else env
        for n, u in (("KFP_POD_NAME", "KFP_POD_UID"), ("POD_NAME", "POD_UID")):
            if env.get(n) and env.get(u):
                return cls(env[n], env[u])
        return None


def owner_refs(owner: Owner | None) -> list[dict]:
    """The ownerReferences of the job's pods and Secret."""
    return [owner.ref()] if owner else []


def in_cluster() -> bool:
    """This process runs in a pod: the API's address and a service-account token are there."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.isfile(SA_DIR + "/token")


def load_api_client(kubeconfig: str | None = None, context: str | None = None):
    """(ApiClient, namespace or None, in_cluster): an explicit kubeconfig, else $KUBECONFIG, else
    the pod's service account, else ~/.kube/config."""
    import kubernetes

    kubeconfig = kubeconfig or os.environ.get("KUBECONFIG") or None
    if kubeconfig is None and in_cluster():
        cfg = kubernetes.client.Configuration()
        kubernetes.config.incluster_config.InClusterConfigLoader(
            token_filename=kubernetes.config.incluster_config.SERVICE_TOKEN_FILENAME,
            cert_filename=kubernetes.config.incluster_config.SERVICE_CERT_FILENAME,
        ).load_and_set(cfg)
        ns = None
        with contextlib.suppress(OSError):
            ns = pathlib.Path(SA_DIR + "/namespace").read_text().strip() or None
        return kubernetes.client.ApiClient(cfg), ns, True
    path = os.path.expanduser(kubeconfig or "~/.kube/config")
    if not os.path.isfile(path):
        raise KubernetesBackendError(
            f"--backend kubernetes found no Kubernetes credentials: the kubeconfig {path} does not exist and "
            "this process does not run in a pod (no service-account token). Set KUBECONFIG, run the step in "
            "the cluster, or use --backend local (subprocesses)."
        )
    try:
        client = kubernetes.config.new_client_from_config(config_file=path, context=context, persist_config=False)
        contexts, current = kubernetes.config.list_kube_config_contexts(path)
    except kubernetes.config.ConfigException as e:
        raise KubernetesBackendError(f"Cannot use the kubeconfig {path}: {e}") from None
    if context:
        current = next((c for c in contexts if c.get("name") == context), current)
    ns = ((current or {}).get("context") or {}).get("namespace")
    return client, ns, False


def master_host(in_cluster: bool) -> str:
    """The address workers reach the master at: its pod IP (downward API), else (in a pod) the
    address of its hostname, else loopback (the test control plane's process kubelets)."""
    for var in (POD_IP_ENV, "POD_IP"):
        if os.environ.get(var):
            return os.environ[var]
    if in_cluster:
        with contextlib.suppress(OSError):
            return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


def load_pod_spec(pod_spec: dict | None) -> dict:
    """The pod spec fields merged into every pod: `pod_spec`, else `ELASTIC_STEP_POD_SPEC` (JSON),
    else none. Its `containers` are merged by name into the role's container (`worker`, `ps`): any field but the
    image and the command, which the backend sets."""
    spec_env = os.environ.get(POD_SPEC_ENV)
    try:
        pod_spec = pod_spec if pod_spec is not None else json.loads(spec_env) if spec_env else {}
    except ValueError as e:
        raise ConfigError(
            f"{POD_SPEC_ENV} is not valid JSON ({e}): give a JSON object of pod spec fields, "
            'e.g. {"nodeSelector": {"pool": "training"}}.'
        ) from None
    if not isinstance(pod_spec, dict):
        raise ConfigError(
            f"{POD_SPEC_ENV} must be a JSON object of pod spec fields, e.g. "
            '{"nodeSelector": {"pool": "training"}}, not ' + type(pod_spec).__name__ + "."
        )
    pod_spec = dict(pod_spec)
    example = '{"containers": [{"name": "worker", "securityContext": {"readOnlyRootFilesystem": true}}]}'
    containers = pod_spec.get("containers", [])
    if not isinstance(containers, list) or not all(isinstance(c, dict) for c in containers):
        raise ConfigError(
            f"{POD_SPEC_ENV}: containers must be a list of objects, each named by a role, e.g. {example}."
        )
    for c in containers:
        if c.get("name") not in ROLES:
            raise ConfigError(
                f"{POD_SPEC_ENV}: the container {c.get('name')!r} is not one the backend builds: containers are merged "
                f"by name into the role's container ({', '.join(ROLES)}), and no other container is added (a sidecar "
                f"would keep a finished worker's pod running), e.g. {example}."
            )
        own = sorted(set(c) & set(BACKEND_CONTAINER_FIELDS))
        if own:
            raise ConfigError(
                f"{POD_SPEC_ENV}: the {c['name']} container may not set {', '.join(own)}: the backend sets it (the "
                "image with worker_image, the command from the job), e.g. " + example + "."
            )
    return pod_spec


def load_pod_labels(pod_labels: dict | None) -> dict[str, dict[str, str]]:
    """Extra labels for the job's pods, by role: `pod_labels`, else `ELASTIC_STEP_POD_LABELS` (JSON),
    else none. Keys are a role (`worker`, `ps`) or `*` (every pod); values are label maps, e.g.
    `{"worker": {"scheduling.x-k8s.io/pod-group": "job-a"}}` puts the workers in a coscheduling
    PodGroup (with `{"schedulerName": ...}` in ELASTIC_STEP_POD_SPEC). The backend's own
    `elastic-step/...` and managed-by labels cannot be overridden: the master finds its pods by them."""
    labels_env = os.environ.get(POD_LABELS_ENV)
    example = '{"worker": {"scheduling.x-k8s.io/pod-group": "job-a"}}'
    try:
        pod_labels = pod_labels if pod_labels is not None else json.loads(labels_env) if labels_env else {}
    except ValueError as e:
        raise ConfigError(f"{POD_LABELS_ENV} is not valid JSON ({e}): give labels by role, e.g. {example}.") from None
    if not isinstance(pod_labels, dict):
        raise ConfigError(f"{POD_LABELS_ENV} must be a JSON object of labels by role, e.g. {example}.")
    out: dict[str, dict[str, str]] = {}
    for role, labels in pod_labels.items():
        if role not in ("worker", "ps", "*"):
            raise ConfigError(f"{POD_LABELS_ENV}: {role!r} is not a role: use 'worker', 'ps' or '*', e.g. {example}.")
        if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            raise ConfigError(f"{POD_LABELS_ENV}: the labels of {role!r} must be an object of strings, e.g. {example}.")
        for k in labels:
            if k.startswith("elastic-step/") or k == "app.kubernetes.io/managed-by":
                raise ConfigError(f"{POD_LABELS_ENV} may not set {k}: the backend sets it and finds its pods by it.")
        out[role] = dict(labels)
    return out
