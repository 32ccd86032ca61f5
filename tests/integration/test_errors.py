"""Bad input gets a one-paragraph error naming the thing and the fix, a non-zero exit, no
traceback, and nothing half-written left looking valid."""

from __future__ import annotations

import json
import os
import socket
import textwrap

import numpy as np
import pytest

from elastic_step.spec import cli_args
from tests.integration.harness import DIGITS_MODEL, run_cli, train


def assert_clean_error(proc, *needles: str) -> str:
    assert proc.returncode != 0
    err = proc.stderr
    assert "Traceback" not in err, err[-3000:]
    line = [l for l in err.splitlines() if l.startswith("elastic-step: error:")]
    assert line, err[-3000:]
    for needle in needles:
        assert needle in line[-1], (needle, line[-1])
    return line[-1]


def write_model(tmp_path, body: str) -> str:
    """A copy of the digits model with one function replaced or removed."""
    src = open(DIGITS_MODEL).read()
    path = tmp_path / "user_model.py"
    path.write_text(src + "\n" + textwrap.dedent(body))
    return str(path)


def test_unreadable_train_data(tmp_path):
    proc = run_cli("train", *cli_args(model_def=DIGITS_MODEL, train_data=tmp_path / "nowhere", output=tmp_path / "out"))
    assert_clean_error(proc, str(tmp_path / "nowhere"), "data prep")
    assert not (tmp_path / "out" / "model.keras").exists()


def test_an_output_the_step_cannot_create_is_a_clear_error(tmp_path, digits_data):
    (tmp_path / "a-file").write_text("not a folder")
    output = str(tmp_path / "a-file" / "out")
    proc = run_cli("train", *cli_args(model_def=DIGITS_MODEL, train_data=digits_data["train"], output=output))
    assert_clean_error(proc, output, "--output")
    assert (tmp_path / "a-file").read_text() == "not a folder"


def test_unreadable_source_in_prep(tmp_path):
    proc = run_cli("data", "prep", *cli_args(source_uri="file:///no/such/file.csv", output=tmp_path / "out"))
    assert_clean_error(proc, "/no/such/file.csv")
    assert not (tmp_path / "out" / "train" / "manifest.json").exists()


def prep_against_schema(tmp_path, csv_text: str):
    """Run `data prep` on a CSV against the schema a, b (float), label."""
    csv = tmp_path / "data.csv"
    csv.write_text(csv_text)
    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps(
            {
                "fields": [
                    {"name": "a", "type": "int64"},
                    {"name": "b", "type": "float64"},
                    {"name": "label", "type": "int64"},
                ]
            }
        )
    )
    return run_cli("data", "prep", *cli_args(source_uri=csv, output=tmp_path / "out", label="label", schema=schema))


def test_bad_row_names_file_line_and_column(tmp_path):
    proc = prep_against_schema(tmp_path, "a,b,label\n1,2.0,0\n3,oops,1\n5,6.0,0\n")
    assert_clean_error(proc, "data.csv", "line 3", "'b'")
    assert not (tmp_path / "out" / "train" / "manifest.json").exists()


def test_schema_mismatch(tmp_path):
    proc = prep_against_schema(tmp_path, "a,label\n1,0\n2,1\n")
    assert_clean_error(proc, "'b'")


def test_non_finite_cells_name_their_column_lines_and_the_flag(tmp_path):
    csv = tmp_path / "data.csv"
    csv.write_text("a,b,label\n1,2.0,0\n3,NaN,1\n5,,0\n7,8.0,1\n")
    args = cli_args(source_uri=csv, output=tmp_path / "out", label="label")
    proc = run_cli("data", "prep", *args)
    assert_clean_error(proc, "column 'b': 1 NaN, 1 empty", "lines 3, 4", "--non-finite drop", "--non-finite zero")
    assert not (tmp_path / "out").exists()
    proc = run_cli("data", "prep", *args, "--non-finite", "drop")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["non_finite_rows"] == 2 and result["train_rows"] + result["eval_rows"] == 2


def test_missing_model_function(tmp_path, digits_data):
    model = write_model(tmp_path, "del feed\n")
    proc, _ = train(digits_data, tmp_path / "out", model=model)
    assert_clean_error(proc, "feed()", "user_model.py")
    assert not (tmp_path / "out" / "model.keras").exists()


def test_model_that_raises_fails_the_job_with_its_error(tmp_path, digits_data):
    model = write_model(
        tmp_path,
        """
        def feed(batch):
            raise ValueError("pixel column has the wrong scale")
    """,
    )
    out = tmp_path / "out"
    proc, summary = train(digits_data, out, model=model, max_workers=2)
    # Met by the master's check of the data, on the first records, before any instance started.
    assert_clean_error(proc, "pixel column has the wrong scale", "feed()", "user_model.py", "before any worker started")
    assert proc.stderr.count("elastic-step: error:") == 1
    assert f'File "{model}", line' in proc.stderr and "in feed" in proc.stderr  # the user's own frame
    assert proc.returncode == 2  # bad input, as a broken contract: no retry policy retries it
    assert summary == {} and not (out / "logs").exists()  # nothing started, nothing relaunched
    assert not (out / "model.keras").exists()
    assert not (out / "saved_model").exists()


def test_model_build_that_raises(tmp_path, digits_data):
    model = write_model(
        tmp_path,
        """
        def model():
            raise RuntimeError("layer sizes do not match")
    """,
    )
    proc, summary = train(digits_data, tmp_path / "out", model=model)
    assert_clean_error(proc, "layer sizes do not match", "model()")
    assert proc.stderr.count("elastic-step: error:") == 1 and proc.returncode == 2
    assert summary == {}  # found by the master's check of the labels, before any instance started
    assert not os.path.exists(tmp_path / "out" / "model.keras")


def test_labels_past_the_models_classes_are_refused_before_training(tmp_path, digits_data):
    model = write_model(tmp_path, "NUM_CLASSES = 9\n")  # labels 0..9 for 9 classes: TensorFlow would stop mid-step
    proc, summary = train(digits_data, tmp_path / "out", model=model)
    assert_clean_error(
        proc, "The training data", "labels 0 to 9", "9 classes on its last axis", "give the model 10 outputs"
    )
    assert summary == {} and proc.returncode == 2


def test_kubernetes_backend_without_a_cluster_is_a_clear_error(tmp_path, digits_data):
    args = (
        "train",
        *cli_args(
            model_def=DIGITS_MODEL, train_data=digits_data["train"], output=tmp_path / "out", backend="kubernetes"
        ),
    )
    missing = str(tmp_path / "no-kubeconfig")
    assert_clean_error(run_cli(*args, env={"KUBECONFIG": missing}), missing, "KUBECONFIG", "--backend local")
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    assert_clean_error(
        run_cli(*args, env={"KUBECONFIG": str(kubeconfig)}),
        f"Cannot reach the Kubernetes API server at https://127.0.0.1:{port}",
        "Connection refused",
        "KUBECONFIG",
    )
    assert not (tmp_path / "out" / "model.keras").exists()


def test_unknown_backend_is_a_clear_error(tmp_path, digits_data):
    proc, _ = train(digits_data, tmp_path / "out", backend="yarn")
    assert_clean_error(proc, "--backend 'yarn'")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ps", "allreduce"])
def test_an_error_in_the_users_loss_is_theirs_once_with_their_traceback(tmp_path, digits_data, strategy):
    model = write_model(
        tmp_path,
        """
        def loss(labels, predictions):
            return scaled(keras.losses.sparse_categorical_crossentropy(labels, predictions))

        def scaled(losses):
            raise ValueError("class weights are missing")
    """,
    )
    out = tmp_path / "out"
    proc, summary = train(digits_data, out, model=model, max_workers=2, strategy=strategy)
    assert_clean_error(proc, "loss()", "class weights are missing", "Fix loss()")
    # The user's own frames, innermost last: where to look, without TensorFlow's.
    assert "user_model.py" in proc.stderr and "in scaled" in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("elastic-step: error:") == 1
    assert summary["status"] == "failed" and summary["workers"]["relaunched"] == 0
    assert "crash" not in proc.stderr.lower().split("elastic-step: error:")[-1]
    assert not (out / "model.keras").exists()


# The tally model (tests/models/tally.py: each record's weights count its updates), whose loss is NaN on one
# record: its label, as feed() gives it, is NaN (as a NaN in the data would be).
NAN_TALLY = """
POISONED = {poisoned}


def loss(labels, predictions):
    return -keras.ops.mean(predictions) + 0.0 * keras.ops.sum(labels)


def feed(batch):
    x, y = tally_feed(batch)
    y[np.asarray(batch["id"]) == POISONED] = np.nan
    return x, y
"""


def nan_tally(tmp_path, tally_data) -> tuple[str, int]:
    from tests.models.witness import TALLY_MODEL, train_ids

    poisoned = int(train_ids(tally_data["train"])[100])
    path = tmp_path / "nan_tally.py"
    source = open(TALLY_MODEL).read().replace("def feed(", "def tally_feed(")
    path.write_text(source + textwrap.dedent(NAN_TALLY.format(poisoned=poisoned)))
    return str(path), poisoned


def shard_ids(manifest_uri: str) -> dict[str, list[int]]:
    """Each training data shard's record ids, in order, by the shard's URI."""
    import pyarrow.parquet as pq

    from elastic_step.data.manifest import load_manifest

    m = load_manifest(manifest_uri)
    return {m.shard_uri(s): pq.read_table(m.shard_uri(s), columns=["id"])["id"].to_pylist() for s in m.shards}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ps", "allreduce"])
def test_a_minibatch_whose_loss_is_not_finite_is_skipped_when_asked_and_counted(tmp_path, tally_data, strategy):
    """--skip-non-finite: the job goes on; nothing of the skipped minibatch is applied (the tally's weights say so,
    not our bookkeeping); summary.json names it (records, worker) and the audit counts its records as skipped."""
    from tests.models import tally

    model, poisoned = nan_tally(tmp_path, tally_data)
    epochs, out = 2, tmp_path / "out"
    settings = {"global_batch": "fixed"} if strategy == "allreduce" else {"num_ps": 2}  # the tally adds 1 per step
    proc, summary = train(
        tally_data,
        out,
        model=model,
        strategy=strategy,
        epochs=epochs,
        max_workers=2,
        skip_non_finite="true",
        minibatch_size=32,
        records_per_task=128,
        **settings,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    skipped = summary["skipped_non_finite"]
    assert skipped["minibatches"] == epochs, skipped  # the poisoned record's minibatch, in each epoch
    ids = shard_ids(tally_data["train"])
    held = [ids[s["data_shard"]][s["start"] : s["end"]] for s in skipped["skipped"]]
    assert all(poisoned in h for h in held), (poisoned, skipped)
    assert all(s["worker"].startswith("worker-") and "the loss became nan" in s["why"] for s in skipped["skipped"])
    assert skipped["records"] == sum(len(h) for h in held)
    # The weights: the skipped minibatch's records were never applied, every other train record once per epoch.
    rows, dense = tally.tallies(str(out / "model.keras"))
    expected = np.zeros(tally.RECORDS)
    for shard in ids.values():
        expected[shard] = epochs
    for h in held:
        expected[h] -= 1
    assert expected[poisoned] == 0
    for name, got in (("embedding rows", rows), ("dense kernel", dense)):
        wrong = np.nonzero(got != expected)[0]
        assert wrong.size == 0, (name, wrong[:10].tolist(), got[wrong[:10]].tolist(), expected[wrong[:10]].tolist())
    # The audit: the model state's own accounting, skipped records as skipped.
    audit = summary["audit"]
    assert audit["verdict"] == "exact", audit
    assert [e.get("skipped", 0) for e in audit["epochs"]] == [len(h) for h in held], audit
    assert "skipped" in proc.stderr and poisoned >= 0
    assert "NaN" not in (out / "summary.json").read_text()  # strict JSON


@pytest.mark.slow
def test_a_loss_that_is_not_finite_fails_the_job_naming_the_records_and_the_worker(tmp_path, tally_data):
    model, poisoned = nan_tally(tmp_path, tally_data)
    proc, summary = train(tally_data, tmp_path / "out", model=model, max_workers=2, minibatch_size=32)
    msg = assert_clean_error(proc, "the loss became nan on records [", "before it was applied", "--skip-non-finite")
    assert "(worker-" in msg and " in epoch 1" in msg, msg
    assert proc.stderr.count("elastic-step: error:") == 1
    assert summary["status"] == "failed" and summary["workers"]["relaunched"] == 0


def test_a_model_overriding_train_step_is_refused_before_any_worker_starts(tmp_path, digits_data):
    model = write_model(
        tmp_path,
        """
        class OwnStep(keras.Model):
            def train_step(self, data):
                return {}

        _plain = model

        def model():
            plain = _plain()
            return OwnStep(plain.inputs, plain.outputs)
        """,
    )
    proc, summary = train(digits_data, tmp_path / "out", model=model)
    assert_clean_error(proc, "overrides train_step() (OwnStep.train_step)", "override compute_loss()")
    assert summary == {} and proc.returncode == 2
