"""The pods' image (elastic_step/backends/kubernetes/image.py): the step's own, its GPU variant for GPU roles."""

from __future__ import annotations

import logging

import pytest

from elastic_step.backends.kubernetes.image import container_image, gpu_variant, role_images, step_pod_name
from elastic_step.errors import ConfigError

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
