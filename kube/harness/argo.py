"""Argo Workflows for tests, built from the Go module proxy by scripts/build-argo (once per version,
into ``${ELASTIC_STEP_CACHE:-~/.cache/elastic-step}/argo-<version>/bin``).

    from kube.harness.argo import build_argo, lint

    lint(["pipelines/argo/train-eval-template.yaml"])   # Argo's offline, strict lint: (ok, its output)
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .controlplane import REPO

BUILD_SCRIPT = REPO / "scripts" / "build-argo"
VERSION = (REPO / "kube" / "argo" / "VERSION").read_text().strip()


class ArgoBuildError(RuntimeError):
    pass


def build_argo(*cmds: str) -> Path:
    """The bin directory holding `cmds` (all of Argo's if none), built when missing."""
    override = os.environ.get("ELASTIC_STEP_ARGO_BIN")
    if override:
        return Path(override)
    proc = subprocess.run([str(BUILD_SCRIPT), *cmds], stdout=subprocess.PIPE, stderr=None, text=True)
    if proc.returncode != 0:
        raise ArgoBuildError(f"{BUILD_SCRIPT} failed with exit code {proc.returncode}")
    return Path(proc.stdout.strip().splitlines()[-1])


def lint(files: list[str | Path]) -> tuple[bool, str]:
    """Argo's own lint of `files`, offline and strict (references resolved among them)."""
    proc = subprocess.run([str(build_argo("argo-lint") / "argo-lint"), *map(str, files)],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode == 0, proc.stdout + proc.stderr
