"""The runtime image, without building it (tests/kubernetes/test_image_pods.py builds and runs it): its recipe
(scripts/build-image) builds what a platform team expects (pinned by constraints.txt, non-root, the CLI as
entrypoint, no build tools left), and the recipe, pyproject, constraints.txt, the compiled components, the Argo
templates and the code all name one image at one version. Also the step's RBAC: namespaced, no wildcards, and the
same as the Kubernetes backend's own Role."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re

import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parents[2]
IMAGE = "ghcr.io/elastic-step/elastic-step"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]


RECIPE = (ROOT / "scripts" / "build-image").read_text()  # the one recipe of the image


def recipe_config(option: str) -> list[str]:
    """The values the recipe gives the image's configuration option ``--config.<option>``."""
    return re.findall(rf'--config\.{re.escape(option)} "?([^"\s]+)"?', RECIPE)


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt must pin exact versions: {line!r}"
            out[canonicalize_name(name)] = version
    return out


# ---------------------------------------------------------------- the recipe (test_image_pods.py runs what it builds)
def test_the_image_is_debians_python_311_within_pyprojects_range():
    assert re.search(r"(?m)^suite=bookworm\b", RECIPE)  # bookworm's python3 is 3.11
    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains("3.11")


def test_the_recipe_installs_the_pins_from_wheels_only_and_leaves_no_pip_or_compiler():
    assert "-r /wheels/requirements.txt -c /wheels/constraints.txt" in RECIPE
    assert "--no-index" in RECIPE and "--no-cache-dir" in RECIPE
    assert "python3 -m venv --without-pip" in RECIPE
    assert not re.search(r"build-essential|\bgcc\b|g\+\+|apt-get install", RECIPE)
    assert '"optional-dependencies"]["s3"]' in RECIPE  # s3fs, which the docs promise for s3:// and MinIO


def test_runs_as_a_numeric_non_root_user_with_the_cli_as_entrypoint():
    (user,) = recipe_config("user")
    uid = user.split(":")[0]
    assert uid.isdigit() and uid != "0", "a numeric non-root uid lets Kubernetes verify runAsNonRoot"
    argo = yaml.safe_load((ROOT / "pipelines" / "argo" / "train-eval-template.yaml").read_text())
    assert argo["spec"]["securityContext"]["runAsUser"] == int(uid)  # the Argo pods run as that user
    assert recipe_config("entrypoint") == ["elastic-step"]
    assert PYPROJECT["project"]["scripts"]["elastic-step"] == "elastic_step.cli:run"


def test_labels_carry_the_version():
    labels = dict(label.split("=", 1) for label in recipe_config("label"))
    assert labels["org.opencontainers.image.version"] == "$version"
    assert re.search(r"(?m)^version=.*pyproject\.toml", RECIPE.replace("\\\n", ""))  # read from pyproject
    assert labels["org.opencontainers.image.title"] == "elastic-step"
    assert labels["org.opencontainers.image.licenses"] == PYPROJECT["project"]["license"]


# ---------------------------------------------------------------- one version everywhere
def test_every_reference_to_the_image_is_this_version():
    expected = f"{IMAGE}:{VERSION}"
    files = [
        p
        for d in ("components", "pipelines", "elastic_step", "images")
        for p in (ROOT / d).rglob("*")
        if p.suffix in (".yaml", ".yml", ".py", ".md") and p.is_file()
    ] + [ROOT / "README.md"]
    found: dict[str, set[str]] = {}
    for f in files:
        for ref in re.findall(re.escape(IMAGE) + r"(?::[\w.{}-]+)?", f.read_text()):
            found.setdefault(ref.replace("{__version__}", VERSION), set()).add(str(f.relative_to(ROOT)))
    assert found, "no image reference found"
    stray = {ref: sorted(where) for ref, where in found.items() if ref not in (expected, IMAGE)}
    assert not stray, f"expected {expected}: {stray}"


def test_compiled_components_and_argo_templates_run_in_this_image():
    expected = f"{IMAGE}:{VERSION}"
    compiled = list((ROOT / "components").rglob("*.yaml")) + list((ROOT / "pipelines").rglob("*.yaml"))
    images = {}
    for f in compiled:
        for image in re.findall(r"(?m)^\s*-?\s*image: ['\"]?([^'\"\s]+)", f.read_text()):
            images.setdefault(image, []).append(str(f.relative_to(ROOT)))
    assert expected in images
    assert set(images) == {expected}, images
    from elastic_step.components.ops import BASE_IMAGE
    from elastic_step.pipelines.argo import IMAGE as ARGO_IMAGE

    assert ARGO_IMAGE == expected
    if "ELASTIC_STEP_IMAGE" not in __import__("os").environ:
        assert BASE_IMAGE == expected


def test_the_package_version_is_pyprojects():
    import elastic_step

    assert elastic_step.__version__ == VERSION


# ---------------------------------------------------------------- pins
def test_constraints_pin_what_pyproject_requires_within_its_ranges():
    pinned = pins()
    deps = PYPROJECT["project"]["dependencies"] + sum(PYPROJECT["project"]["optional-dependencies"].values(), [])
    for dep in map(Requirement, deps):
        name = canonicalize_name(dep.name)
        assert name in pinned, f"{dep.name} is required but not pinned in constraints.txt"
        assert dep.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {dep.name}=={pinned[name]}, outside pyproject's {dep.specifier}"
        )


def test_the_tests_run_with_the_pins_the_image_installs():
    """The environment these tests run in is the image's: same versions of every runtime dependency."""
    pinned = pins()
    wrong = {}
    for dep in map(Requirement, PYPROJECT["project"]["dependencies"]):
        name = canonicalize_name(dep.name)
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != pinned[name]:
            wrong[dep.name] = (installed, pinned[name])
    assert not wrong, f"(installed, pinned): {wrong}; run scripts/bootstrap"


# ---------------------------------------------------------------- RBAC
def rbac(path: pathlib.Path) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(path.read_text()) if d}


def rules(role: dict) -> set[tuple[str, str, str]]:
    return {
        (g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }


def test_rbac_is_namespaced_exact_and_without_wildcards():
    docs = rbac(ROOT / "components" / "elastic_train" / "rbac.yaml")
    assert {k for k, _ in docs} == {"ServiceAccount", "Role", "RoleBinding"}  # nothing cluster-wide
    role = docs[("Role", "elastic-step")]
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        assert "resourceNames" not in rule or rule["resourceNames"]
    assert rules(role) == {("", "pods", v) for v in ("create", "get", "list", "watch", "delete", "patch")} | {
        ("", "secrets", v) for v in ("create", "get", "delete")
    } | {
        ("kueue.x-k8s.io", "localqueues", "get"),
        ("kueue.x-k8s.io", "workloads", "list"),
    } | {
        ("events.k8s.io", "events", v) for v in ("create", "patch")
    }  # a queue: its LocalQueue, looked up before any pod; its Workloads, read to say why a pod waits; the step's
    # Events, created and their series patched
    binding = docs[("RoleBinding", "elastic-step")]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "elastic-step"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "elastic-step"}]
    assert all("namespace" not in d["metadata"] for d in docs.values()), "applied with -n <namespace>"


def test_rbac_agrees_with_the_kubernetes_backends_role():
    backend = ROOT / "elastic_step" / "backends" / "manifests" / "role.yaml"
    ours, theirs = rbac(ROOT / "components" / "elastic_train" / "rbac.yaml"), rbac(backend)
    assert set(ours) == set(theirs)
    for key in ours:
        if key[0] == "Role":
            assert rules(ours[key]) == rules(theirs[key]), key
        elif key[0] == "RoleBinding":
            assert ours[key]["roleRef"] == theirs[key]["roleRef"] and ours[key]["subjects"] == theirs[key]["subjects"]
