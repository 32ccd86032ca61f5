"""What the benches share: preparing a source into train and eval manifests with the real CLI."""
from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def prepare(source: str, out: pathlib.Path, label: str = "label") -> pathlib.Path:
    """`elastic-step data prep` of `source` into `out` (train/ and eval/ manifests); returns `out`."""
    subprocess.run([sys.executable, "-m", "elastic_step.cli", "data", "prep", "--source", source,
                    "--label", label, "--output", str(out)], cwd=ROOT, check=True, capture_output=True)
    return out
