"""The job's pods pass the restricted Pod Security level, and ELASTIC_STEP_POD_SPEC merges into them without breaking
it (no cluster needed; tests/kubernetes/test_pod_security.py has the apiserver's own check)."""

import json

import pytest

from elastic_step.backends.kubernetes.config import POD_SPEC_ENV, load_pod_spec
from elastic_step.backends.kubernetes.security import restricted_violations
from elastic_step.backends.kubernetes.settings import PodSettings
from elastic_step.errors import ConfigError
from elastic_step.master.api import TrainConfig
from tests.unit.backends.pods import job_pod


@pytest.mark.parametrize("role", ["worker", "ps"])
def test_the_backend_s_pods_are_restricted(role):
    settings = PodSettings.from_train_config(
        TrainConfig(model_def="m.py", train_data="t", output="o", volumes="pvc:data:/data,emptydir:s:/s").validate()
    )
    spec = job_pod(role, settings=settings)["spec"]
    assert restricted_violations(spec) == []
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000
    assert spec["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_the_pod_spec_merges_into_the_role_s_container_by_name(monkeypatch):
    given = {
        "securityContext": {"fsGroup": 2000},
        "containers": [
            {
                "name": "worker",
                "securityContext": {"readOnlyRootFilesystem": True},
                "env": [{"name": "EXTRA", "value": "1"}, {"name": "ELASTIC_STEP_JOB_ID", "value": "not-mine"}],
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            }
        ],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    monkeypatch.setenv(POD_SPEC_ENV, json.dumps(given))
    worker, ps = (job_pod(role, pod_spec=load_pod_spec(None))["spec"] for role in ("worker", "ps"))
    (c,) = worker["containers"]
    assert c["name"] == "worker" and c["image"] == "img" and c["command"] == ["run"]
    # merged: the variable's fields beside the backend's, the backend's own env names win
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
    }
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["EXTRA"] == "1" and env["ELASTIC_STEP_JOB_ID"] == "j"
    assert c["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert worker["securityContext"]["fsGroup"] == 2000 and worker["securityContext"]["runAsNonRoot"] is True
    assert "readOnlyRootFilesystem" not in ps["containers"][0]["securityContext"]  # the worker's container only
    assert restricted_violations(worker) == [] == restricted_violations(ps)


# ELASTIC_STEP_POD_SPEC overrides that break the restricted level, and what the error names of each.
BREAKING = [
    ({"securityContext": {"runAsUser": 0}}, "spec.securityContext.runAsUser: must not be 0"),
    ({"securityContext": {"runAsNonRoot": False}}, "containers[worker].securityContext.runAsNonRoot"),
    ({"securityContext": {"seccompProfile": {"type": "Unconfined"}}}, "seccompProfile: must not be Unconfined"),
    ({"hostNetwork": True}, "spec.hostNetwork: must not be true"),
    ({"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}, "spec.volumes[0] (h): a hostPath volume"),
    (
        {"containers": [{"name": "worker", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]},
        "capabilities.add: SYS_ADMIN",
    ),
    (
        {"containers": [{"name": "worker", "securityContext": {"allowPrivilegeEscalation": True}}]},
        "containers[worker].securityContext.allowPrivilegeEscalation: must be false",
    ),
    ({"containers": [{"name": "worker", "securityContext": {"privileged": True}}]}, "privileged: must not be"),
]


@pytest.mark.parametrize(("override", "named"), BREAKING)
def test_what_breaks_restricted_is_named(override, named):
    broken = restricted_violations(job_pod("worker", pod_spec=load_pod_spec(override))["spec"])
    assert any(named in b for b in broken), broken


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"containers": [{"name": "sidecar", "image": "x"}]}, "'sidecar' is not one the backend builds"),
        ({"containers": [{"name": "worker", "image": "x"}]}, "the worker container may not set image"),
        ({"containers": [{"name": "ps", "command": ["x"]}]}, "the ps container may not set command"),
        ({"containers": {"name": "worker"}}, "containers must be a list of objects"),
    ],
)
def test_containers_the_backend_does_not_build_or_its_own_fields_are_refused(bad, says):
    with pytest.raises(ConfigError, match=POD_SPEC_ENV) as e:
        load_pod_spec(bad)
    assert says in str(e.value)
