"""The backend's errors: what the cluster refused or failed, with the fix in the message."""

from __future__ import annotations

from elastic_step.backends.api import BackendError
from elastic_step.errors import ElasticStepError


class KubernetesBackendError(BackendError, ElasticStepError):
    """The cluster refused or failed a request; the message names it and the fix. `status`: the
    API's HTTP status (None: the API server could not be reached)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class KubernetesPermissionError(KubernetesBackendError):
    """The step's service account lacks a verb on a resource (RBAC 403)."""
