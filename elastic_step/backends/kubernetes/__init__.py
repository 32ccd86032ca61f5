"""Kubernetes backend: every instance is a pod in the step's namespace (see backend.py)."""
# The names below are what code imported from the single module this package replaced.
from elastic_step.backends.kubernetes.backend import (_JOB_ID, DEFAULT_IMAGE, DEFAULT_PRIORITY, LABEL_INDEX, LABEL_JOB,
                                                      LABEL_LAUNCH, LABEL_ROLE, MANAGED_BY, MANIFESTS, NAMESPACE_ENV,
                                                      NEEDED, POD_IP_ENV, POD_SPEC_ENV, PRIORITY_FILE, ROLE_FILE, SA_DIR,
                                                      TERMINAL, TOKEN_KEY, KubernetesBackend, KubernetesBackendError,
                                                      KubernetesPermissionError, Owner, load_api_client, load_manifests,
                                                      master_host, permission_error)

__all__ = [
    "DEFAULT_IMAGE", "DEFAULT_PRIORITY", "KubernetesBackend", "KubernetesBackendError", "KubernetesPermissionError",
    "LABEL_INDEX", "LABEL_JOB", "LABEL_LAUNCH", "LABEL_ROLE", "MANAGED_BY", "MANIFESTS", "NAMESPACE_ENV", "NEEDED",
    "Owner", "POD_IP_ENV", "POD_SPEC_ENV", "PRIORITY_FILE", "ROLE_FILE", "SA_DIR", "TERMINAL", "TOKEN_KEY",
    "_JOB_ID", "load_api_client", "load_manifests", "master_host", "permission_error",
]
