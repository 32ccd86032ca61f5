"""Configuration: the cluster's credentials and namespace, the pod that owns the job's pods, the
address the master listens at, and the pod spec fields the environment adds to every pod."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import socket

from elastic_step import __version__
from elastic_step.backends.kubernetes.errors import KubernetesBackendError
from elastic_step.errors import ConfigError

DEFAULT_IMAGE = f"ghcr.io/elastic-step/elastic-step:{__version__}"
POD_IP_ENV = "ELASTIC_STEP_POD_IP"
POD_SPEC_ENV = "ELASTIC_STEP_POD_SPEC"
NAMESPACE_ENV = "ELASTIC_STEP_NAMESPACE"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclasses.dataclass(frozen=True)
class Owner:
    """The pod that owns the job's pods and Secret (deleting it deletes them)."""
    name: str
    uid: str

    def ref(self) -> dict:
        return {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid,
                "controller": False, "blockOwnerDeletion": False}

    @classmethod
    def from_env(cls, env=None) -> "Owner | None":
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
            "the cluster, or use --backend local (subprocesses).")
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
    else none. The backend builds the container itself."""
    spec_env = os.environ.get(POD_SPEC_ENV)
    try:
        pod_spec = pod_spec if pod_spec is not None else json.loads(spec_env) if spec_env else {}
    except ValueError as e:
        raise ConfigError(f"{POD_SPEC_ENV} is not valid JSON ({e}): give a JSON object of pod spec fields, "
                          'e.g. {"nodeSelector": {"pool": "training"}}.') from None
    if not isinstance(pod_spec, dict):
        raise ConfigError(f"{POD_SPEC_ENV} must be a JSON object of pod spec fields, e.g. "
                          '{"nodeSelector": {"pool": "training"}}, not ' + type(pod_spec).__name__ + ".")
    pod_spec = dict(pod_spec)
    if "containers" in pod_spec:
        raise ConfigError(f"{POD_SPEC_ENV} may not set containers: the backend builds the container.")
    return pod_spec
