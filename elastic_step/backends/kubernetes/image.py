"""The image of the job's pods: the step's own, unless `worker_image` names another.

By default the workers and parameter servers run the image the step itself runs in, read from the step's pod
through the API (`get` on pods, which the Role grants): the pod KFP names (`KFP_POD_NAME`), else the one the
downward API names (`POD_NAME`, as the Argo template sets it), else, in a pod, the pod's own name (its hostname).
Its container `main` (KFP's and Argo's name for the step's container), else its only container. So a pipeline
compiled on another image, or pinned by digest, runs its workers on that same image.

A role with accelerators (`worker_accelerators`, `ps_accelerators`) runs the GPU variant of that image: the same
reference with `-gpu` after the tag (`registry.example.com/ml/elastic-step:1.2` -> `...:1.2-gpu`, as
`make image GPU=1` names it). An image given explicitly is taken as it is, once it is a reference a container
runtime can pull (a malformed one is a ConfigError before any pod exists, not pods that never start); given without
the `-gpu` suffix to a role with GPUs, the backend warns that TensorFlow's CPU build would leave the GPUs idle.
"""

from __future__ import annotations

import logging
import os
import re
import socket

from elastic_step import __version__
from elastic_step.errors import ConfigError

log = logging.getLogger("elastic_step.backends.kubernetes")

GPU_SUFFIX = "-gpu"
STEP_CONTAINER = "main"  # KFP's and Argo's name for the container of a step
EXAMPLE = f"ghcr.io/elastic-step/elastic-step:{__version__}"


# An image reference as container runtimes parse it (the distribution project's grammar): [registry[:port]/]path, in
# lowercase components, then an optional :tag and @algorithm:digest.
_LABEL = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_REFERENCE = re.compile(rf"(?:{_HOST}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::{_TAG})?(?:@{_DIGEST})?")


def check_reference(image: str) -> str:
    """`image`, given as worker_image, if a container runtime can pull it; else a ConfigError saying why."""
    if _REFERENCE.fullmatch(image):
        return image
    if image.startswith(("/", ".", "oci:")) or image.partition(":")[0].endswith("/oci"):
        why = (
            "it is a path, such as the OCI layout `make image` writes, which no node can pull: push the layout to a "
            "registry first (skopeo copy oci:<layout>:<tag> docker://<registry>/<name>:<tag>) and give that name"
        )
    elif image != image.strip() or not image:
        why = "it is empty or has spaces around it"
    else:
        why = (
            "a repository is lowercase letters and digits with . _ - between them, after an optional registry host, "
            "then an optional :tag and @sha256:<64 hex digits>"
        )
    raise ConfigError(
        f"worker_image {image!r} is not an image reference a container runtime can pull: {why}. Give one such as "
        f"{EXAMPLE}, or leave worker_image empty to run the step's own image."
    )


def step_pod_name(in_cluster: bool, env=None) -> str | None:
    """The name of the step's own pod: KFP's, the downward API's, else (in a pod) its hostname."""
    env = os.environ if env is None else env
    for var in ("KFP_POD_NAME", "POD_NAME"):
        if env.get(var):
            return env[var]
    # The runtime sets HOSTNAME to the pod's hostname, its name unless the pod sets spec.hostname.
    return (env.get("HOSTNAME") or socket.gethostname()) if in_cluster else None


def _split(image: str) -> tuple[str, str, str]:
    """(repository, tag, digest) of an image reference; tag and digest may be empty."""
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        return name[:colon], name[colon + 1 :], digest
    return name, "", digest


def gpu_variant(image: str) -> str:
    """The GPU variant of a CPU image: the same reference with `-gpu` after the tag."""
    repo, tag, digest = _split(image)
    if tag.endswith(GPU_SUFFIX):
        return image
    if digest:
        raise ConfigError(
            f"The step runs the image {image}, pinned by digest, and its GPU variant cannot be named from it: "
            f"set worker_image to the GPU image for GPU workers, e.g. worker_image={EXAMPLE}{GPU_SUFFIX}."
        )
    return f"{repo}:{tag or 'latest'}{GPU_SUFFIX}"


def is_gpu_image(image: str) -> bool:
    return _split(image)[1].endswith(GPU_SUFFIX)


def container_image(pod: dict) -> str:
    """The image of a step pod's own container: `main`, else its only container."""
    containers = (pod.get("spec") or {}).get("containers") or []
    name = (pod.get("metadata") or {}).get("name", "")
    mine = [c for c in containers if c.get("name") == STEP_CONTAINER] or (containers if len(containers) == 1 else [])
    if not mine or not mine[0].get("image"):
        raise ConfigError(
            f"Cannot tell the image of the step from its pod {name}: it has no container named {STEP_CONTAINER!r} "
            f"and not exactly one container ({', '.join(c.get('name', '?') for c in containers) or 'none'}). Set "
            f"worker_image to the image the workers and parameter servers run, e.g. worker_image={EXAMPLE}."
        )
    return mine[0]["image"]


def no_step_pod() -> ConfigError:
    return ConfigError(
        "worker_image is not set and the master does not run in a pod (no KFP_POD_NAME or POD_NAME, and no "
        "service-account token), so the workers and parameter servers have no image to run: set worker_image "
        f"(--worker-image) to the image they run, e.g. worker_image={EXAMPLE}."
    )


def role_images(given: str | None, step_image, accelerators: dict[str, dict]) -> dict[str, str]:
    """The image of each role's pods. `given`: worker_image (or None); `step_image()`: the step's own (called only
    when needed); `accelerators`: each role's extended resources."""
    out = {}
    base = check_reference(given) if given else step_image()
    for role, resources in accelerators.items():
        if not resources:
            out[role] = base
        elif not given:
            out[role] = gpu_variant(base)
        else:
            out[role] = base
            if not is_gpu_image(base):
                log.warning(
                    "%s pods ask for %s but run the image %s, given explicitly, whose tag does not end in %s: if it "
                    "holds TensorFlow's CPU build, they train on their CPUs while the GPUs they hold sit idle, paid "
                    "for. Give the GPU image (e.g. %s%s), or leave worker_image empty to run the step's image's GPU "
                    "variant.",
                    role,
                    ", ".join(f"{k}={v}" for k, v in resources.items()),
                    base,
                    GPU_SUFFIX,
                    EXAMPLE,
                    GPU_SUFFIX,
                )
    return out
