"""Permissions: what the backend may do in the namespace, and what it says when it may not.

The backend checks the verbs it needs (SelfSubjectAccessReview) when it is constructed and
turns any 403 into a `KubernetesPermissionError` naming the verb, the resource and the Role
to fix (manifests/role.yaml). It needs only that namespaced Role.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import re

from elastic_step.backends.kubernetes.config import NAMESPACE_ENV
from elastic_step.backends.kubernetes.errors import KubernetesBackendError, KubernetesPermissionError

# One logger for the whole backend, whichever module speaks: users filter on it.
log = logging.getLogger("elastic_step.backends.kubernetes")

# The manifests stay beside the backends (the components and the README name that folder).
MANIFESTS = pathlib.Path(__file__).resolve().parent.parent / "manifests"
ROLE_FILE = "elastic_step/backends/manifests/role.yaml"

# Everything the backend does, and so everything the Role must grant (no more).
NEEDED = (
    ("create", "pods"),
    ("get", "pods"),
    ("list", "pods"),
    ("watch", "pods"),
    ("delete", "pods"),
    ("patch", "pods"),
    ("create", "secrets"),
    ("get", "secrets"),
    ("delete", "secrets"),
)


def permission_error(missing: list[tuple[str, str]], namespace: str, who: str = "") -> KubernetesPermissionError:
    who = who or "the service account"
    if who.startswith("system:serviceaccount:"):
        who = f"the service account {who}"
    elif not who.startswith("the "):
        who = f"the user {who}"
    what = ", ".join(f"{v} {r}" for v, r in missing)
    fix = ", ".join(f"'{v}' on '{r}'" for v, r in missing)
    return KubernetesPermissionError(
        f"{who} cannot {what} in namespace {namespace}: add {fix} to its Role (see {ROLE_FILE}).", 403
    )


def load_manifests(name: str, namespace: str | None = None) -> list[dict]:
    """The documents of manifests/<name>.yaml (role, priorityclasses), namespaced if asked."""
    import yaml

    docs = [d for d in yaml.safe_load_all((MANIFESTS / f"{name}.yaml").read_text()) if d]
    if namespace:
        for d in docs:
            if d["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
                d["metadata"]["namespace"] = namespace
            for s in d.get("subjects") or []:
                if s.get("kind") == "ServiceAccount":
                    s["namespace"] = namespace
    return docs


def translate(e, verb: str, resource: str, namespace: str) -> Exception:
    """The error to raise for the API's refusal `e` of `verb resource` in `namespace`."""
    try:
        message = json.loads(e.body).get("message", "") if e.body else ""
    except (ValueError, AttributeError):
        message = str(e.body or e.reason)
    if e.status == 403:
        m = re.search(r'User "([^"]+)" cannot (\w+) resource "([^"]+)"', message)
        if m:
            return permission_error([(m.group(2), m.group(3))], namespace, m.group(1))
        return KubernetesBackendError(f"{verb} {resource} in namespace {namespace} was refused: {message}", 403)
    if e.status == 401:
        return KubernetesBackendError(
            f"The Kubernetes API rejected the step's credentials (401 {message}): give "
            "it a valid token (the step's service account, or KUBECONFIG).",
            401,
        )
    if e.status == 404 and re.search(r'namespaces? "[^"]+" not found', message):
        return KubernetesBackendError(
            f"The namespace {namespace} does not exist: create it, or set "
            f"{NAMESPACE_ENV} to the namespace the step runs in.",
            404,
        )
    return KubernetesBackendError(
        f"{verb} {resource} in namespace {namespace} failed ({e.status} {e.reason}): {message}", e.status
    )


def check_permissions(
    k8s,
    api,
    namespace: str,
    call,
    extra: tuple[tuple[str, str, str], ...] = (),
    wanted: dict[tuple[str, str, str], str] | None = None,
) -> None:
    """Fail before anything is created when the Role lacks a verb (not after training, when
    the pods could not be deleted). `k8s`: the kubernetes.client module; `api`: its ApiClient;
    `call`: the backend's API call (it turns refusals into the errors above); `extra`: (verb, resource,
    API group) a setting needs besides NEEDED (a Kueue queue: get localqueues); `wanted`: rights the job does
    without, each with what its lack costs: a warning, not an error."""
    auth = k8s.AuthorizationV1Api(api)
    missing = []
    wanted = wanted or {}
    for verb, resource, group in [(v, r, "") for v, r in NEEDED] + list(extra) + list(wanted):
        body = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {
                "resourceAttributes": {"namespace": namespace, "verb": verb, "resource": resource, "group": group}
            },
        }
        try:
            r = call(
                "create",
                "selfsubjectaccessreviews",
                auth.create_self_subject_access_review,
                body,
                _preload_content=False,
            )
        except KubernetesPermissionError:
            raise
        except KubernetesBackendError as e:
            if e.status in (None, 401):  # unreachable, bad credentials: nothing else would work
                raise
            log.warning("cannot check permissions (%s); relying on the API's answers", e)
            return
        if json.loads(r.data).get("status", {}).get("allowed"):
            continue
        if (verb, resource, group) in wanted:
            log.warning(
                "the step's Role lacks %s on %s.%s in namespace %s: %s (the shipped Role grants it: %s)",
                verb,
                resource,
                group,
                namespace,
                wanted[(verb, resource, group)],
                ROLE_FILE,
            )
        else:
            missing.append((verb, resource))
    if missing:
        who = ""
        with contextlib.suppress(Exception):
            r = k8s.AuthenticationV1Api(api).create_self_subject_review(
                {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}, _preload_content=False
            )
            who = json.loads(r.data)["status"]["userInfo"]["username"]
        raise permission_error(missing, namespace, who)
