"""Kubernetes backend: every instance is a pod in the step's namespace.

    backend = KubernetesBackend.from_train_config(cfg, job_id, token)   # what `--backend kubernetes` does

One module per concern, each documenting its part of the semantics:

    backend.py      KubernetesBackend: the Backend contract (start, stop, kill, close); one
                    identity, one process (a relaunch waits for its predecessor's end)
    pods.py         what the job's pods look like (names, labels, spec) and what is known of each
    watch.py        events: the watch of the job's pods and what each pod version means
    adoption.py     restart: a new master takes over the pods its predecessor left
    secret.py       the job's token Secret, kept across a restart
    permissions.py  the verbs the Role must grant, checked up front; refusals as errors
    config.py       credentials, namespace, owner, the master's address, extra pod spec fields
    image.py        the pods' image: the step's own (its GPU variant for GPU roles) unless worker_image is set
    settings.py     the pod settings of each role (resources, placement, spot, env, volumes), parsed once
    errors.py       KubernetesBackendError, KubernetesPermissionError
"""

# The names below are what code imported from the single module this package replaced.
from elastic_step.backends.kubernetes.backend import KubernetesBackend
from elastic_step.backends.kubernetes.config import (
    NAMESPACE_ENV,
    POD_IP_ENV,
    POD_LABELS_ENV,
    POD_SPEC_ENV,
    SA_DIR,
    Owner,
    load_api_client,
    master_host,
)
from elastic_step.backends.kubernetes.errors import KubernetesBackendError, KubernetesPermissionError
from elastic_step.backends.kubernetes.permissions import MANIFESTS, NEEDED, ROLE_FILE, load_manifests, permission_error
from elastic_step.backends.kubernetes.pods import (
    _JOB_ID,
    DEFAULT_PRIORITY,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_LAUNCH,
    LABEL_ROLE,
    MANAGED_BY,
    PRIORITY_FILE,
    TERMINAL,
    TOKEN_KEY,
)

__all__ = [
    "DEFAULT_PRIORITY",
    "KubernetesBackend",
    "KubernetesBackendError",
    "KubernetesPermissionError",
    "LABEL_INDEX",
    "LABEL_JOB",
    "LABEL_LAUNCH",
    "LABEL_ROLE",
    "MANAGED_BY",
    "MANIFESTS",
    "NAMESPACE_ENV",
    "NEEDED",
    "Owner",
    "POD_IP_ENV",
    "POD_LABELS_ENV",
    "POD_SPEC_ENV",
    "PRIORITY_FILE",
    "ROLE_FILE",
    "SA_DIR",
    "TERMINAL",
    "TOKEN_KEY",
    "_JOB_ID",
    "load_api_client",
    "load_manifests",
    "master_host",
    "permission_error",
]
