"""Fixtures for the local-backend integration tests: real processes, gRPC and TensorFlow."""
from __future__ import annotations

import os
import sys

import pytest

from tests.integration.harness import ROOT


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory):
    from elastic_step.data.prep import prepare

    out = tmp_path_factory.mktemp("digits")
    r = prepare(os.path.join(ROOT, "samples", "digits", "digits.csv"), str(out), label="label", seed=0)
    return {"train": r.train_uri, "eval": r.eval_uri, "rows": r.train.total_rows}


@pytest.fixture(scope="session")
def ctr_data(tmp_path_factory):
    sys.path.insert(0, ROOT)
    from elastic_step.data.prep import prepare
    from samples.ctr.generate import generate

    out = tmp_path_factory.mktemp("ctr")
    csv = out / "ctr.csv"
    generate(str(csv), rows=12000, seed=0)
    r = prepare(str(csv), str(out / "prepared"), label="clicked", seed=0)
    return {"train": r.train_uri, "eval": r.eval_uri, "rows": r.train.total_rows}
