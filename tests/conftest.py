"""Put the repository root on sys.path, so tests import `samples.*` (and the package) from the checkout;
the prepared data sets the integration and parity tests share."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tally_data(tmp_path_factory):
    """The tally model's data (tests/models/tally.py), for the exactly-once witnesses."""
    from tests.models.witness import prepare_tally_data
    return prepare_tally_data(tmp_path_factory.mktemp("tally"))


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory):
    """samples/digits/digits.csv prepared (seed 0): 1,438 train rows, 359 eval rows."""
    from elastic_step.data.prep import prepare

    out = tmp_path_factory.mktemp("digits")
    r = prepare(os.path.join(ROOT, "samples", "digits", "digits.csv"), str(out), label="label", seed=0)
    return {"train": r.train_uri, "eval": r.eval_uri, "rows": r.train.total_rows}


@pytest.fixture(scope="session")
def ctr_data(tmp_path_factory):
    """12,000 rows of samples/ctr/generate.py (seed 0) prepared: 9,600 train rows, 2,400 eval rows."""
    from elastic_step.data.prep import prepare
    from samples.ctr.generate import generate

    out = tmp_path_factory.mktemp("ctr")
    csv = out / "ctr.csv"
    generate(str(csv), rows=12000, seed=0)
    r = prepare(str(csv), str(out / "prepared"), label="clicked", seed=0)
    return {"train": r.train_uri, "eval": r.eval_uri, "rows": r.train.total_rows}
