"""The pods' image (elastic_step/backends/kubernetes/image.py): the step's own, its GPU variant for GPU roles."""

from __future__ import annotations

import logging
import sys

import pytest

from elastic_step.backends.api import InstanceId, InstanceSpec
from elastic_step.backends.kubernetes.adoption import compatible
from elastic_step.backends.kubernetes.image import container_image, gpu_variant, role_images, step_pod_name
from elastic_step.backends.kubernetes.pods import container_command, track
from elastic_step.errors import ConfigError
from tests.unit.backends.pods import job_pod

GPU = {"nvidia.com/gpu": "1"}


@pytest.mark.parametrize(
    ("image", "gpu"),
    [
        ("registry.example.com/ml/elastic-step:1.2", "registry.example.com/ml/elastic-step:1.2-gpu"),
        ("localhost:5000/elastic-step:0.1.0", "localhost:5000/elastic-step:0.1.0-gpu"),
        ("localhost:5000/elastic-step", "localhost:5000/elastic-step:latest-gpu"),
        ("elastic-step:1.2-gpu", "elastic-step:1.2-gpu"),
    ],
)
def test_the_gpu_variant_is_the_tag_with_the_gpu_suffix(image, gpu):
    assert gpu_variant(image) == gpu


def test_a_digest_pinned_step_image_has_no_gpu_variant_to_name():
    with pytest.raises(ConfigError, match="pinned by digest.*set worker_image to the GPU image"):
        gpu_variant("registry.example.com/ml/elastic-step@sha256:" + "0" * 64)


def test_each_role_runs_the_step_s_image_and_gpu_roles_its_variant():
    asked = []

    def step():
        asked.append(1)
        return "r/e:1"

    assert role_images(None, step, {"worker": GPU, "ps": {}}) == {"worker": "r/e:1-gpu", "ps": "r/e:1"}
    assert role_images("mine:2", step, {"worker": {}, "ps": {}}) == {"worker": "mine:2", "ps": "mine:2"}
    assert asked == [1]  # the step's pod is read only when no image is given


def test_a_cpu_image_given_to_gpu_workers_warns_of_the_cost(caplog):
    with caplog.at_level(logging.WARNING, "elastic_step.backends.kubernetes"):
        assert role_images("mine:2", lambda: "unused", {"worker": GPU, "ps": {}})["worker"] == "mine:2"
        role_images("mine:2-gpu", lambda: "unused", {"worker": GPU, "ps": {}})
    (record,) = caplog.records
    assert "worker pods ask for nvidia.com/gpu=1 but run the image mine:2" in record.getMessage()
    assert "sit idle, paid for" in record.getMessage()


def test_the_step_s_container_is_main_or_its_only_one():
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "wait", "image": "argoexec"}]}}
    assert container_image(pod) == "argoexec"
    pod["spec"]["containers"].append({"name": "main", "image": "step:1"})
    assert container_image(pod) == "step:1"
    pod["spec"]["containers"][1]["name"] = "other"
    with pytest.raises(ConfigError, match="Cannot tell the image of the step from its pod p.*Set worker_image"):
        container_image(pod)


def test_the_step_s_pod_is_kfp_s_then_the_downward_api_s_then_its_hostname():
    env = {"KFP_POD_NAME": "kfp", "POD_NAME": "downward", "HOSTNAME": "host"}
    assert step_pod_name(True, env) == "kfp"
    assert step_pod_name(False, {"POD_NAME": "downward"}) == "downward"
    assert step_pod_name(True, {"HOSTNAME": "host"}) == "host"
    assert step_pod_name(False, {"HOSTNAME": "host"}) is None  # outside a pod there is no step pod


def test_the_pods_run_the_image_s_python_not_the_master_s_interpreter():
    """The master's interpreter is a path on its own machine (a laptop's venv): the pod runs the image's `python`, and
    a retried master's adoption compares the same command."""
    argv = [sys.executable, "-m", "elastic_step.worker", "--index", "0"]
    body = job_pod("worker", argv=argv)
    assert body["spec"]["containers"][0]["command"] == ["python", "-m", "elastic_step.worker", "--index", "0"]
    pod = track({}, {**body, "metadata": {**body["metadata"], "uid": "u"}})
    assert compatible(pod, InstanceSpec(InstanceId("worker", 0), argv), token_reused=True)
    assert not compatible(pod, InstanceSpec(InstanceId("worker", 0), [*argv, "--other"]), token_reused=True)
    assert container_command(["/opt/other/python", "-c", "x"]) == ["/opt/other/python", "-c", "x"]


@pytest.mark.parametrize(
    "image",
    [
        "registry.example.com/ml/elastic-step:1.2",
        "localhost:5000/elastic-step",
        "elastic-step",
        "ghcr.io/elastic-step/elastic-step:0.1.0-gpu",
        "registry.example.com/ml/elastic-step@sha256:" + "0" * 64,
        "registry.example.com/ml/elastic-step:1.2@sha256:" + "a" * 64,
        "[::1]:5000/a_b/c--d:v1.2_x",
    ],
)
def test_a_pullable_worker_image_is_taken_as_given(image):
    assert role_images(image, lambda: "unused", {"worker": {}, "ps": {}}) == {"worker": image, "ps": image}


@pytest.mark.parametrize(
    ("image", "why"),
    [
        ("/root/.cache/elastic-step/image/cpu-1/oci:0.1.0", "push the layout to a registry first"),
        ("oci:/tmp/layout:0.1.0", "push the layout to a registry first"),
        ("Registry.example.com/ML/Elastic-Step:1.2", "lowercase"),
        ("elastic-step:", "optional :tag"),
        ("elastic step:1.2", "lowercase"),
        (" elastic-step:1.2", "spaces around it"),
        ("elastic-step@sha256:abc", "@sha256:<64 hex digits>"),
    ],
)
def test_a_worker_image_no_runtime_can_pull_is_an_error_naming_it_before_any_pod(image, why):
    asked = []
    with pytest.raises(ConfigError) as e:
        role_images(image, lambda: asked.append(1), {"worker": {}, "ps": {}})
    message = str(e.value)
    assert f"worker_image {image!r} is not an image reference a container runtime can pull" in message
    assert why in message and "ghcr.io/elastic-step/elastic-step:" in message
    assert asked == []
