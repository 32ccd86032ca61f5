"""Pod Security on the real apiserver: the test namespaces enforce the `restricted` level (the PodSecurity admission
plugin), a pod that breaks it is refused there, the job's pods are admitted and run, and what the backend refuses up
front (elastic_step/backends/kubernetes/security.py) is what the apiserver refuses too."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from elastic_step.backends.api import EventKind, InstanceId, InstanceSpec
from elastic_step.backends.kubernetes import POD_SPEC_ENV
from elastic_step.backends.kubernetes.config import load_pod_spec
from elastic_step.errors import ConfigError
from tests.infra.kube.harness.controlplane import POD_SECURITY_LABEL
from tests.kubernetes.test_backend import (  # noqa: F401
    SLEEPER,
    Events,
    job_backend,
    job_pods,
    sa_kubeconfig,
    secret_exists,
)
from tests.unit.backends.pods import job_pod
from tests.unit.backends.test_k8s_security import BREAKING

pytestmark = pytest.mark.kubernetes


def dry_run(core, namespace: str, pod: dict) -> client.ApiException | None:
    """The apiserver's answer to creating `pod` (not stored) in `namespace`: None when admitted, else its refusal."""
    pod["metadata"]["namespace"] = namespace
    try:
        core.create_namespaced_pod(namespace, pod, dry_run="All")
    except client.ApiException as e:
        return e
    return None


def test_the_namespace_is_restricted_and_refuses_a_pod_that_breaks_it(core, namespace):
    assert core.read_namespace(namespace).metadata.labels[POD_SECURITY_LABEL] == "restricted"
    plain = {
        "metadata": {"name": "plain"},
        "spec": {"containers": [{"name": "main", "image": "x", "command": ["sleep", "1"]}]},
    }
    refused = dry_run(core, namespace, plain)
    assert refused is not None and refused.status == 403, refused
    body = json.loads(refused.body)["message"]
    assert 'violates PodSecurity "restricted:latest"' in body and "allowPrivilegeEscalation != false" in body, body


def test_the_job_s_pods_are_admitted_and_run_with_a_container_override_merged(
    core, node, namespace, sa_kubeconfig, monkeypatch
):
    override = {"containers": [{"name": "worker", "securityContext": {"readOnlyRootFilesystem": True}}]}
    monkeypatch.setenv(POD_SPEC_ENV, json.dumps(override))
    b = job_backend("admitted", sa_kubeconfig, namespace)
    try:
        ev = Events(b)
        w0, ps0 = InstanceId("worker", 0), InstanceId("ps", 0)
        b.start(InstanceSpec(w0, SLEEPER))
        b.start(InstanceSpec(ps0, SLEEPER))
        ev.wait(EventKind.RUNNING, w0)
        ev.wait(EventKind.RUNNING, ps0)
        pods = {p.metadata.labels["elastic-step/role"]: p for p in job_pods(core, namespace, "admitted")}
    finally:
        b.close()
    worker = pods["worker"].spec
    assert worker.security_context.run_as_non_root and worker.security_context.run_as_user == 1000
    assert worker.security_context.seccomp_profile.type == "RuntimeDefault"
    sc = worker.containers[0].security_context
    assert (sc.allow_privilege_escalation, sc.capabilities.drop, sc.read_only_root_filesystem) == (False, ["ALL"], True)
    assert pods["ps"].spec.containers[0].security_context.read_only_root_filesystem is None


@pytest.mark.parametrize(("override", "named"), BREAKING)
def test_an_override_the_apiserver_would_refuse_is_an_error_before_any_pod(
    core, namespace, sa_kubeconfig, monkeypatch, override, named
):
    # the apiserver refuses the pod the override gives: the backend's check is not stricter than the level
    pod = job_pod("worker", pod_spec=load_pod_spec(override))
    assert dry_run(core, namespace, pod) is not None
    assert dry_run(core, namespace, job_pod("worker")) is None  # and admits it without the override
    monkeypatch.setenv(POD_SPEC_ENV, json.dumps(override))
    with pytest.raises(ConfigError) as e:
        job_backend("refused", sa_kubeconfig, namespace)
    assert "would break the restricted Pod Security Standard" in str(e.value) and named in str(e.value), e.value
    assert job_pods(core, namespace, "refused") == [] and not secret_exists(core, namespace, "refused-token")
