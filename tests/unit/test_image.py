"""The runtime image, the compiled components, the Argo templates and pyproject agree on one version
and one image name, and the Dockerfile builds what a platform team expects (no Docker engine here)."""
from __future__ import annotations

import pathlib
import re
import tomllib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
IMAGE = "ghcr.io/elastic-step/elastic-step"


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "images" / "Dockerfile").read_text())
    return [tuple(l.split(None, 1)) for l in text.splitlines() if l.strip() and not l.lstrip().startswith("#")]


def test_dockerfile_is_slim_pinned_non_root_with_the_cli_as_entrypoint():
    steps = dockerfile()
    froms = [a for i, a in steps if i == "FROM"]
    assert froms and all(a.startswith("python:3.11-slim") for a in froms)
    runs = " ".join(a for i, a in steps if i == "RUN")
    assert "-c constraints.txt" in runs and "--no-cache-dir" in runs
    assert f"elastic-step=={version()}" in runs
    assert any(i == "USER" and a.strip() not in ("root", "0") for i, a in steps)
    assert ("ENTRYPOINT", '["elastic-step"]') in steps
    label = " ".join(a for i, a in steps if i == "LABEL")
    assert f'image.version="{version()}"' in label
    assert not re.search(r"apt-get install|build-essential|gcc", runs)


def test_components_and_argo_use_this_version_of_the_image():
    expected = f"{IMAGE}:{version()}"
    files = list((ROOT / "components").rglob("*.yaml")) + list((ROOT / "pipelines").rglob("*.yaml"))
    images = set()
    for f in files:
        images.update(re.findall(r"(?m)^\s*-?\s*image: (\S+)", f.read_text()))
    assert images, "no image reference found"
    assert images == {expected}, images


def test_constraints_pin_what_pyproject_requires():
    pins = dict(l.split("==") for l in (ROOT / "constraints.txt").read_text().splitlines() if "==" in l)
    pins = {k.lower().replace("_", "-"): v for k, v in pins.items()}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        name = re.split(r"[<>=!~\s\[]", dep, 1)[0].lower()
        assert name in pins, f"{name} is required but not pinned in constraints.txt"


def test_rbac_is_namespaced_and_without_wildcards():
    docs = list(yaml.safe_load_all((ROOT / "components" / "elastic_train" / "rbac.yaml").read_text()))
    kinds = {d["kind"] for d in docs}
    assert kinds == {"ServiceAccount", "Role", "RoleBinding"}
    role = next(d for d in docs if d["kind"] == "Role")
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
    pods = next(r for r in role["rules"] if r["resources"] == ["pods"])
    assert set(pods["verbs"]) == {"create", "get", "list", "watch", "delete", "patch"}
