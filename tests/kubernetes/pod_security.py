"""The pods the tests create themselves (a step's pod, another team's workload, an intruder) carry the same security
context as the project's pods, so the restricted namespaces they run in admit them, as a tenant's would have to."""

from __future__ import annotations

from elastic_step.backends.kubernetes.security import CONTAINER_SECURITY_CONTEXT, POD_SECURITY_CONTEXT, merge


def restricted(pod: dict) -> dict:
    """`pod` (a Pod, or a pod spec, or an Argo workflow spec) with the restricted level's security contexts added
    under what it sets itself."""
    spec = pod.get("spec", pod) if "metadata" in pod else pod
    spec["securityContext"] = merge(POD_SECURITY_CONTEXT, spec.get("securityContext") or {})
    for kind in ("initContainers", "containers"):
        for c in spec.get(kind) or []:
            c["securityContext"] = merge(CONTAINER_SECURITY_CONTEXT, c.get("securityContext") or {})
    return pod


def restricted_container(container: dict) -> dict:
    """An Argo template's container with the restricted level's container security context."""
    return {**container, "securityContext": merge(CONTAINER_SECURITY_CONTEXT, container.get("securityContext") or {})}
