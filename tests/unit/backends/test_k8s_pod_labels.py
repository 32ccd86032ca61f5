"""ELASTIC_STEP_POD_LABELS: extra labels on the job's pods, by role (no cluster needed)."""

import json

import pytest

from elastic_step.backends.kubernetes.config import POD_LABELS_ENV, load_pod_labels
from elastic_step.errors import ConfigError
from tests.unit.backends.pods import job_pod

GROUP = "scheduling.x-k8s.io/pod-group"


def body(role: str, labels: dict) -> dict:
    return job_pod(role, spec={"cpu": "1"}, pod_spec={"schedulerName": "gang"}, pod_labels=load_pod_labels(labels))


def test_labels_by_role_and_for_all():
    labels = {"worker": {GROUP: "j"}, "*": {"team": "a"}}
    worker, ps = body("worker", labels), body("ps", labels)
    assert worker["metadata"]["labels"][GROUP] == "j" and worker["metadata"]["labels"]["team"] == "a"
    assert GROUP not in ps["metadata"]["labels"] and ps["metadata"]["labels"]["team"] == "a"
    assert worker["metadata"]["labels"]["elastic-step/role"] == "worker"
    assert worker["spec"]["schedulerName"] == "gang"


def test_from_environment(monkeypatch):
    monkeypatch.setenv(POD_LABELS_ENV, json.dumps({"worker": {GROUP: "g"}}))
    assert load_pod_labels(None) == {"worker": {GROUP: "g"}}
    monkeypatch.delenv(POD_LABELS_ENV)
    assert load_pod_labels(None) == {}


@pytest.mark.parametrize(
    "bad", ['{"worker": ', '["x"]', '{"chief": {}}', '{"worker": {"a": 1}}', '{"*": {"elastic-step/job": "other"}}']
)
def test_rejected(monkeypatch, bad):
    monkeypatch.setenv(POD_LABELS_ENV, bad)
    with pytest.raises(ConfigError, match=POD_LABELS_ENV):
        load_pod_labels(None)
