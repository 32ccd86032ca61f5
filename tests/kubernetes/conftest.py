"""Fixtures for tests against a real control plane (tests.infra.kube.harness).

* ``control_plane`` (session): builds the binaries when missing (scripts/build-control-plane,
  minutes the first time, then instant) and starts etcd, kube-apiserver, kube-scheduler and
  kube-controller-manager on loopback. ``control_plane.kubeconfig_path`` is an admin
  kubeconfig, ``control_plane.api_client()`` an admin ApiClient,
  ``control_plane.add_token(user, groups)`` adds a user, ``control_plane.add_node(...)`` a
  process-kubelet node.
* ``node`` (session): a general-purpose node, ``node-1`` (8 cpu, 16Gi, 50 pods).
* ``namespace``: a fresh namespace per test (deleted afterwards), ready for pods, enforcing the ``restricted``
  Pod Security level as tenant namespaces do: every pod the project creates must pass it. A test that needs a
  lower level says so with ``@pytest.mark.pod_security("baseline")`` (or ``"privileged"``), and why.
* ``core``: an admin CoreV1Api.
* ``kueue`` (session, started by the first test that asks for it): Kueue's real manager
  (tests.infra.kube.harness.kueue.Kueue: built once by scripts/build-kueue, CRDs, webhooks).
* ``kueue_namespace``: the test's ``namespace``, opted in to Kueue (its pods with a queue name are gated).

The project's image: every node runs the pods of the project's image (ghcr.io/elastic-step/elastic-step, and the same
image as a platform's registry names it, ``jobs.STEP_IMAGE``) inside that image under runc, as a cluster does: the
step, its workers and its PS run the image's code, as its user, on its Python. The image is the one scripts/build-image
builds (``project_image``). The pods see the repository's sample, test and bench models and this session's temporary
directories at their own paths (the nodes' shared filesystem); each test's ``tmp_path`` is writable by the image's
user, the session's other folders readable. A harness self-test that needs no image says so with
``@pytest.mark.process_pods("why")``: its pods of the project's image are then processes of this checkout's
environment (its venv's ``python`` first on their PATH). A test marked ``gpu_image`` runs the pods of the image's GPU
variant (``-gpu`` tags: a role with accelerators) inside the GPU image (``project_gpu_image``, TensorFlow's CUDA
build; no GPU here, so it trains on the CPU); other tests run them in the CPU image.

Every test under tests/kubernetes gets the ``kubernetes`` marker.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path

import pytest

kubernetes = pytest.importorskip("kubernetes")
from tests.infra.kube.harness import ControlPlane, wait_for  # noqa: E402,F401
from tests.kubernetes.images import checkout_images, in_the_image  # noqa: E402

HERE = Path(__file__).resolve().parent
log = logging.getLogger("tests.kubernetes")


def _ours(item) -> bool:
    return HERE in Path(str(item.fspath)).resolve().parents


def pytest_configure(config):
    config.addinivalue_line("markers", "pod_security(level): the Pod Security level the test's namespace enforces")
    config.addinivalue_line(
        "markers", "process_pods(why): the test's pods of the project's image run as processes of this checkout"
    )
    config.addinivalue_line("markers", "gpu_image: the test's pods of the GPU variant run inside the GPU image")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _ours(item):
            item.add_marker(pytest.mark.kubernetes)


@pytest.fixture(scope="session")
def control_plane():
    t0 = time.monotonic()
    with ControlPlane(node_defaults={"images": checkout_images()}) as cp:
        log.warning(
            "control plane: build %.1fs, start %.1fs (%s); work dir %s",
            cp.timings.get("build", 0.0),
            cp.timings["start"],
            ", ".join(f"{k} {v:.1f}s" for k, v in cp.timings.items() if k not in ("build", "start")),
            cp.workdir,
        )
        yield cp
    log.warning("control plane session %.1fs", time.monotonic() - t0)


@pytest.fixture(scope="session")
def node(control_plane):
    return control_plane.add_node("node-1", cpu="8", memory="16Gi", pods=50)


@pytest.fixture
def core(control_plane):
    return kubernetes.client.CoreV1Api(control_plane.api_client())


_ns_counter = itertools.count(1)


@pytest.fixture
def namespace(control_plane, core, request):
    name = f"t{os.getpid() % 10000}-{next(_ns_counter)}-{request.node.name[:30]}".lower().replace("_", "-")
    name = "".join(c for c in name if c.isalnum() or c == "-").strip("-")[:63]
    marker = request.node.get_closest_marker("pod_security")
    control_plane.create_namespace(name, pod_security=marker.args[0] if marker else "restricted")
    yield name
    try:
        core.delete_namespace(name, propagation_policy="Background")
    except kubernetes.client.ApiException:
        pass


@pytest.fixture(scope="session")
def kueue(control_plane):
    from tests.infra.kube.harness.kueue import Kueue

    with Kueue(control_plane) as k:
        log.warning(
            "kueue: build %.1fs, start %.1fs (%s)",
            k.timings.get("build", 0.0),
            k.timings["start"],
            ", ".join(f"{n} {v:.1f}s" for n, v in k.timings.items() if n not in ("build", "start")),
        )
        yield k


@pytest.fixture
def kueue_namespace(kueue, namespace):
    """A namespace Kueue manages; the ClusterQueues, flavors and priority classes made for it go with the test."""
    kueue.opt_in(namespace)
    mark = len(kueue.cluster_objects)
    yield namespace
    kueue.delete_since(mark)


def runtime_image(*args: str, override_env: str):
    """scripts/build-image ``args`` (a no-op when built, else it builds, or waits on the lock of the build
    scripts/test started in the background), unpacked once for runc (tests.infra.kube.harness.oci)."""
    from tests.infra.kube.harness.oci import unpacked_image
    from tests.infra.kube.harness.process import REPO, run_build

    t0 = time.monotonic()
    layout = run_build(REPO / "scripts" / "build-image", *args, override_env=override_env)
    image = unpacked_image(layout)
    log.warning("runtime image %s: built and unpacked in %.1fs", layout, time.monotonic() - t0)
    return image


@pytest.fixture(scope="session")
def project_image():
    """The runtime image."""
    return runtime_image(override_env="ELASTIC_STEP_IMAGE_LAYOUT")


@pytest.fixture(scope="session")
def project_gpu_image():
    """The runtime image's GPU variant (scripts/test builds it after the CPU image)."""
    return runtime_image("--gpu", override_env="ELASTIC_STEP_GPU_IMAGE_LAYOUT")


@pytest.fixture(autouse=True)
def pods_in_the_image(request):
    """Every node of the test's control plane runs the project's image's pods inside it (module docstring), unless
    the test is marked ``process_pods`` or needs no control plane."""
    if "control_plane" not in request.fixturenames or request.node.get_closest_marker("process_pods"):
        yield
        return
    control_plane = request.getfixturevalue("control_plane")
    image, factory = request.getfixturevalue("project_image"), request.getfixturevalue("tmp_path_factory")
    if "tmp_path" in request.fixturenames:
        from tests.kubernetes.jobs import share_with_pods

        share_with_pods(request.getfixturevalue("tmp_path"), writable=True)
    gpu = request.getfixturevalue("project_gpu_image") if request.node.get_closest_marker("gpu_image") else None
    with in_the_image(control_plane, image, factory, gpu):
        yield


@pytest.fixture
def image_node(node, control_plane, project_image, tmp_path_factory):
    """``node``, running the pods of the project's image inside it under runc for the test, whatever its marks."""
    with in_the_image(control_plane, project_image, tmp_path_factory):
        yield node
