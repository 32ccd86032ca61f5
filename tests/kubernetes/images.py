"""The project's image on the test control plane's nodes: run inside it under runc (``in_the_image``), or, for a
harness self-test, as processes of this checkout and its venv (``checkout_images``). Its GPU variant (the tag with
``-gpu``, what a role with accelerators runs) is the GPU image when a test is given one, else the CPU image."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from elastic_step.backends.kubernetes.image import gpu_variant
from elastic_step.pipelines.argo import IMAGE
from tests.infra.kube.harness.pod import Image, image_repository
from tests.infra.kube.harness.process import REPO
from tests.kubernetes.jobs import STEP_IMAGE


def project_repositories() -> tuple[str, ...]:
    """The repositories (image names without tag) of the project's image: its own, and a platform registry's."""
    return tuple(image_repository(i) for i in (IMAGE, STEP_IMAGE))


def checkout_images() -> dict:
    """A process node's view of the project's image: this checkout and its venv (its ``python`` first on PATH)."""
    image = Image((Path(sys.executable).parent,), (REPO, Path(sys.prefix)))
    return dict.fromkeys(project_repositories(), image)


@contextlib.contextmanager
def in_the_image(control_plane, project_image, tmp_path_factory, gpu_image=None):
    """Within: every node of ``control_plane`` (those added meanwhile too) runs the pods of the project's image inside
    it under runc (those of its GPU variant inside ``gpu_image`` when given), and their containers see the
    repository's sample, test and bench models and this session's temporary directories at their own paths, the
    session's folders readable by the image's user."""
    base = tmp_path_factory.getbasetemp()
    for folder in (base, *base.iterdir()):  # pytest makes them for its user alone; the image's is another
        if folder.is_dir():
            folder.chmod(folder.stat().st_mode | 0o055)
    dress = {
        "oci_images": {
            **dict.fromkeys(project_repositories(), project_image),
            **(dict.fromkeys((gpu_variant(i) for i in (IMAGE, STEP_IMAGE)), gpu_image) if gpu_image else {}),
        },
        "shared_paths": tuple(
            str(p) for p in (REPO / "samples", REPO / "tests" / "models", REPO / "bench" / "models", base)
        ),
    }
    defaults = dict(control_plane.node_defaults)
    before = {name: (dict(n.oci_images), n.shared_paths) for name, n in control_plane.nodes.items()}
    control_plane.node_defaults.update(dress)
    for n in control_plane.nodes.values():
        n.oci_images.update(dress["oci_images"])
        n.shared_paths = dress["shared_paths"]
    try:
        yield
    finally:
        control_plane.node_defaults = defaults
        for name, n in control_plane.nodes.items():
            n.oci_images, n.shared_paths = before.get(name, ({}, ()))
