"""Fixtures for tests against a real control plane (kube.harness).

* ``control_plane`` (session): builds the binaries when missing (scripts/build-control-plane,
  minutes the first time, then instant) and starts etcd, kube-apiserver, kube-scheduler and
  kube-controller-manager on loopback. ``control_plane.kubeconfig_path`` is an admin
  kubeconfig, ``control_plane.api_client()`` an admin ApiClient,
  ``control_plane.add_token(user, groups)`` adds a user, ``control_plane.add_node(...)`` a
  process-kubelet node.
* ``node`` (session): a general-purpose node, ``node-1`` (8 cpu, 16Gi, 50 pods).
* ``namespace``: a fresh namespace per test (deleted afterwards), ready for pods.
* ``core``: an admin CoreV1Api.

Every test under tests/kubernetes gets the ``kubernetes`` marker.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from pathlib import Path

import pytest

kubernetes = pytest.importorskip("kubernetes")
from kube.harness import ControlPlane, build_control_plane, wait_for  # noqa: E402,F401

HERE = Path(__file__).resolve().parent
log = logging.getLogger("tests.kubernetes")


def _ours(item) -> bool:
    return HERE in Path(str(item.fspath)).resolve().parents


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _ours(item):
            item.add_marker(pytest.mark.kubernetes)


def pytest_collection_finish(session):
    """Build the control plane here, once, when a test of ours is selected: outside any
    test's timeout (the first build takes minutes), with its progress on the terminal."""
    if session.config.option.collectonly or not any(_ours(item) for item in session.items):
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    ctx = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    t0 = time.monotonic()
    with ctx:
        bin_dir = build_control_plane()
    took = time.monotonic() - t0
    if took > 5:
        session.config.get_terminal_writer().line(f"control plane built in {took:.0f}s into {bin_dir}")


@pytest.fixture(scope="session")
def control_plane():
    t0 = time.monotonic()
    with ControlPlane() as cp:
        log.warning("control plane: build %.1fs, start %.1fs (%s); work dir %s",
                    cp.timings.get("build", 0.0), cp.timings["start"],
                    ", ".join(f"{k} {v:.1f}s" for k, v in cp.timings.items() if k not in ("build", "start")),
                    cp.workdir)
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
    control_plane.create_namespace(name)
    yield name
    try:
        core.delete_namespace(name, propagation_policy="Background")
    except kubernetes.client.ApiException:
        pass

