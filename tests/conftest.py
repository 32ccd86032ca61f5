"""Put the repository root on sys.path, so tests import `samples.*` (and the package) from the checkout;
the prepared data sets the integration and parity tests share; a temporary folder for the session's processes."""

import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


import pytest  # noqa: E402

# Tests that need Go-built servers run in the order scripts/test builds them: on a machine without them,
# it builds them in the background while the rest of the suite runs, and these wait on the builds' locks.
# The first test of each group may wait for a whole cold build (minutes alone, more on a busy machine):
# its timeout allows for that. A group is named by path prefixes, or by the fixture that starts its server.
NEEDS_GO_BUILDS = (
    ("kueue",),  # + Kueue: every test that asks for the `kueue` fixture
    ("tests/kubernetes/test_argo_controller.py", "tests/pipeline/test_argo.py"),  # + Argo
    ("tests/kubernetes/",),  # the control plane
)
BUILD_WAIT_S = 2700


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(session, config, items):
    def builds_needed(item) -> int:
        path = os.path.relpath(str(item.fspath), ROOT).replace(os.sep, "/")
        fixtures = getattr(item, "fixturenames", ())

        def needs(names) -> bool:
            return any(path.startswith(n) if "/" in n else n in fixtures for n in names)

        return next((len(NEEDS_GO_BUILDS) - i for i, names in enumerate(NEEDS_GO_BUILDS) if needs(names)), 0)

    # Under xdist (scripts/test: `--dist loadgroup`, groups handed out as queued), the tests that need
    # Go-built servers are one group, queued first and run in the builds' order on one worker: one control
    # plane, and on a cold machine that worker waits for the builds while the other runs the rest. Every
    # other module is a group, so that its module-scoped fixtures (a parity model trained, a job run) are
    # made once. In one process they run last instead, while the builds run.
    # (Items are collected in xdist's workers, where the order becomes the queue's: there xdist sets `loadgroup`
    # and turns `dist` to "no".)
    needed = {item: builds_needed(item) for item in items}
    if getattr(config.option, "loadgroup", False):
        items.sort(key=lambda item: (needed[item] == 0, needed[item]))
    else:
        items.sort(key=needed.get)  # stable: the order within each group stays as collected
    for item in items:
        group = "go-built" if needed[item] else os.path.relpath(str(item.fspath), ROOT)
        item.add_marker(pytest.mark.xdist_group(group))
    for group in range(1, len(NEEDS_GO_BUILDS) + 1):
        first = next((item for item in items if needed[item] == group), None)
        if first is not None:
            own = first.get_closest_marker("timeout")
            base = own.args[0] if own and own.args else config.getini("timeout")
            first.add_marker(pytest.mark.timeout(float(base or 0) + BUILD_WAIT_S), append=False)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Under `--dist loadgroup` every test carries its group: xdist suffixes its node id with it. Without the
    suffixes xdist hands the tests out one by one (pytest-dev/pytest-xdist#1386): a control plane on each worker
    and every module fixture made again. Stop before the first test rather than run slow and uneven."""
    if node.config.getoption("dist") == "loadgroup" and ids and not any("@" in nodeid for nodeid in ids):
        pytest.exit(
            f"pytest-xdist's loadgroup lost the test groups on {node.gateway.id} (its first test: {ids[0]}): "
            "this pytest and pytest-xdist do not work together. Install the versions constraints.txt pins "
            "(./scripts/bootstrap).",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


@pytest.fixture(scope="session", autouse=True)
def own_tmpdir(tmp_path_factory):
    """Every process the suite starts keeps its temporary files (a remote output's staging, a model's copy, a slow
    worker's gate) in a folder of this session's, removed at its end: a master or worker a chaos test SIGKILLs
    never cleans up after itself, and the machine's /tmp is not the place for what it leaves."""
    tmp_path_factory.getbasetemp()  # pytest's own folders first, where they always are (a failed test's are kept)
    tempfile.gettempdir()  # this process's own stay where they are too (multiprocessing removes its own at exit)
    folder = tempfile.mkdtemp(prefix="elastic-step-tests-")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = folder  # for the processes it starts
    yield folder
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    shutil.rmtree(folder, ignore_errors=True)


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


@pytest.fixture(scope="session")
def gcs_server():
    """fake-gcs-server on loopback (built by scripts/build-fake-gcs when missing)."""
    from tests.infra.stores.harness import GcsServer

    with GcsServer() as server:
        yield server


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on loopback."""
    from tests.infra.stores.harness import S3Server

    with S3Server() as server:
        yield server


@pytest.fixture(params=["gs", "s3"])
def store(request, monkeypatch):
    """(server, URI of a fresh bucket) on each real store, with this process's environment pointing
    at the server as a step's would (subprocesses get `server.env` passed)."""
    import uuid

    import fsspec

    server = request.getfixturevalue({"gs": "gcs_server", "s3": "s3_server"}[request.param])
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    fsspec.config.conf.setdefault(server.protocol, {}).update(server.storage_options)
    yield server, server.bucket("t-" + uuid.uuid4().hex[:12])
    fsspec.config.conf.pop(server.protocol, None)
