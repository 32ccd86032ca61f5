"""Put the repository root on sys.path, so tests import `samples.*` (and the package) from the checkout."""
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
