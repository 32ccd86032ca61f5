"""The whole step on real object stores: gs:// on fake-gcs-server (through gcsfs), s3:// on moto's S3
server (through s3fs), both started by the suite on loopback (tests/infra/stores/harness.py).

Data prep reads the source from the bucket and writes shards and manifests there; the training step
reads its leases from the bucket and writes its checkpoints, model, summary and report there; a killed
master's retried step resumes from the bucket's checkpoint; evaluate reads the model and data from the
bucket and publish copies the model within it. Exactly-once is witnessed by the tally model's weights,
downloaded from the bucket.
"""

from __future__ import annotations

import json
import os

import pytest

from elastic_step.spec import cli_args
from elastic_step.steps import evaluate_step, publish_step
from tests.integration.harness import SMALL_LEASES, run_cli, train
from tests.models import tally
from tests.models.witness import TALLY_MODEL, assert_audit_exact, assert_each_record_applied_exactly

EPOCHS = 2


@pytest.mark.slow
def test_prep_train_resume_evaluate_and_publish_all_in_the_bucket(store, tmp_path):
    server, bucket = store
    fs = server.filesystem()
    tally.write_csv(str(tmp_path / "tally.csv"))
    fs.put_file(str(tmp_path / "tally.csv"), f"{bucket}/source/tally.csv")

    prep = cli_args(source_uri=f"{bucket}/source/tally.csv", output=f"{bucket}/prepared", label="label")
    proc = run_cli("data", "prep", *prep, env=server.env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = {"train": f"{bucket}/prepared/train/manifest.json", "eval": f"{bucket}/prepared/eval/manifest.json"}
    assert fs.exists(data["train"]) and fs.exists(data["eval"])
    rows = json.loads(fs.cat_file(data["train"]))["shards"][0]["rows"]

    output = f"{bucket}/run"
    job = {
        "job_id": "in-bucket",
        "epochs": EPOCHS,
        "max_workers": 1,
        "num_ps": 1,
        **SMALL_LEASES,
        "checkpoint_every": 2000,  # a cut at about 2000 records, before the kill at 60 % of 4800
    }
    killed_at = int(rows * EPOCHS * 0.6)
    proc, _ = train(data, output, "--chaos", f"kill:master@{killed_at}", model=TALLY_MODEL, env=server.env, **job)
    assert proc.returncode == -9, proc.stderr[-3000:]  # the chaos fired: the master died mid-run
    assert not fs.exists(f"{output}/summary.json")  # nothing claims a finished output
    cut = json.loads(fs.cat_file(f"{output}/checkpoints/in-bucket/checkpoint.json"))
    # The kill fired at `fired` records (its journal beside the checkpoints), after any cut that was due first.
    fired = json.loads(fs.cat_file(f"{output}/checkpoints/in-bucket/chaos.json"))["fired"][-1]["at_records"]
    # A cut abandoned (its barrier not held in time) would let the kill outrun it: the master's log says so.
    assert killed_at <= fired and 0 < cut["records_committed"] <= fired, (cut, fired, proc.stderr[-3000:])

    proc, _ = train(data, output, model=TALLY_MODEL, env=server.env, **job)  # the retried step
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming job in-bucket from checkpoint" in proc.stderr
    summary = json.loads(fs.cat_file(f"{output}/summary.json"))
    assert [r["from_checkpoint"] for r in summary["checkpoints"]["restarts"]] == [cut["id"]]
    assert summary["outputs"]["keras"] == f"{output}/model.keras"
    for name in ("model.keras", "saved_model/saved_model.pb", "report.html"):
        assert fs.exists(f"{output}/{name}"), name
    assert not fs.exists(f"{output}/checkpoints/in-bucket/checkpoint.json")  # done: a rerun starts over
    local = tmp_path / "downloaded"
    local.mkdir()
    fs.get_file(f"{output}/model.keras", str(local / "model.keras"))
    assert_each_record_applied_exactly(local, data, EPOCHS)
    assert_audit_exact(summary)

    # Evaluate and publish as their pipeline steps call them (in this process: no TensorFlow start-up).
    result = evaluate_step(output, data["eval"], TALLY_MODEL, metric="loss", threshold=0.0)
    assert result["metrics"]["records"] == json.loads(fs.cat_file(data["eval"]))["shards"][0]["rows"]
    assert publish_step(output, f"{bucket}/published", passed=result["passed"]) == f"{bucket}/published"
    assert fs.cat_file(f"{bucket}/published/model.keras") == fs.cat_file(f"{output}/model.keras")
    assert fs.exists(f"{bucket}/published/saved_model/saved_model.pb")


def test_a_missing_bucket_is_one_paragraph_naming_the_uri_and_the_fix(store, tmp_path):
    server, _ = store
    (tmp_path / "d.csv").write_text("x,label\n1,0\n2,1\n3,0\n")
    missing = f"{server.protocol}://no-such-bucket-here"
    proc = run_cli("data", "prep", *cli_args(source_uri=f"{missing}/d.csv", output=tmp_path / "out"), env=server.env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{missing}/d.csv" in proc.stderr
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.keras").write_bytes(b"a model")
    proc = run_cli("publish", "--model", str(tmp_path / "model"), "--to", f"{missing}/model", env=server.env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{missing}/model" in proc.stderr and "bucket" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["d.csv", "model"]


def test_a_lease_fetches_only_the_row_groups_it_spans(store, monkeypatch):
    """A worker's reader against the store, bytes counted where the store's client fetches them (the
    file class's ranged GET), against the sizes Parquet's own metadata gives."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from elastic_step.data.reader import ShardReader

    server, bucket = store
    fs = server.filesystem()
    rows, group = 32768, 1024
    table = pa.table({f"x{i}": np.random.default_rng(i).random(rows).astype("float32") for i in range(64)})
    shard = f"{bucket}/shard.parquet"
    with fs.open(shard, "wb") as f:
        pq.write_table(table, f, row_group_size=group)
    size = fs.size(shard)
    with fs.open(shard, "rb") as f:
        meta = pq.ParquetFile(f).metadata
        file_class = type(f)
    footer = meta.serialized_size + 8
    fetched = []
    real = file_class._fetch_range
    monkeypatch.setattr(
        file_class, "_fetch_range", lambda self, start, end: fetched.append(end - start) or real(self, start, end)
    )

    reader = ShardReader(shard)
    opened = sum(fetched)
    got = reader.read(5 * group + 100, 7 * group - 100)  # a lease across row groups 5 and 6
    reader.close()
    assert np.array_equal(got["x3"], table.column("x3").to_numpy()[5 * group + 100 : 7 * group - 100])
    spanned = sum(meta.row_group(i).column(c).total_compressed_size for i in (5, 6) for c in range(64))
    assert opened <= footer + 64 * 1024, (opened, footer)  # the footer (and a little before it)
    assert sum(fetched) - opened <= spanned * 1.05, (sum(fetched) - opened, spanned)
    assert len(fetched) <= 4, fetched  # a GET or two per read, not one per column
    assert sum(fetched) < size / 8, (sum(fetched), size)


def test_missing_s3_credentials_are_one_paragraph_naming_the_uri_and_the_standard_ways(s3_server, tmp_path):
    bucket = s3_server.bucket("t-no-credentials")
    env = {
        "AWS_ENDPOINT_URL": s3_server.url,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }
    prep = cli_args(source_uri=f"{bucket}/d.csv", output=tmp_path / "out")
    proc = run_cli("data", "prep", *prep, env=env, unset=[k for k in os.environ if k.startswith("AWS_")], timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{bucket}/d.csv" in proc.stderr
    assert "AWS_ACCESS_KEY_ID" in proc.stderr and "IRSA" in proc.stderr and "AWS_ENDPOINT_URL" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def s3_with_iam():
    from tests.infra.stores.harness import S3ServerWithIam

    with S3ServerWithIam("t-iam") as server:
        yield server


def test_credentials_the_store_refuses_are_one_paragraph(s3_with_iam, tmp_path):
    """moto with IAM on: a key the store does not know is refused, as AWS refuses it."""
    env = {**s3_with_iam.env, "AWS_ACCESS_KEY_ID": "AKIAUNKNOWN000000000", "AWS_SECRET_ACCESS_KEY": "wrong"}
    source = "s3://t-iam/source/d.csv"
    proc = run_cli("data", "prep", *cli_args(source_uri=source, output=tmp_path / "out"), env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"Cannot read the source {source}" in proc.stderr and "refused" in proc.stderr
    assert "AWS_SECRET_ACCESS_KEY" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_missing_permission_is_one_paragraph_and_nothing_is_written(s3_with_iam, tmp_path):
    """moto with IAM on: a user whose policy allows only reads cannot publish, and is told which
    permission its identity lacks; the bucket holds nothing of the attempt."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.keras").write_bytes(b"a model")
    proc = run_cli(
        "publish", "--model", str(tmp_path / "model"), "--to", "s3://t-iam/model", env=s3_with_iam.reader_env
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "Cannot publish the model to s3://t-iam/model" in proc.stderr
    assert "lack the permission" in proc.stderr and "s3:PutObject" in proc.stderr
    import fsspec

    reader = fsspec.filesystem(
        "s3",
        key=s3_with_iam.reader_env["AWS_ACCESS_KEY_ID"],
        endpoint_url=s3_with_iam.url,
        secret=s3_with_iam.reader_env["AWS_SECRET_ACCESS_KEY"],
        skip_instance_cache=True,
    )
    assert reader.ls("t-iam", refresh=True) == []  # listed as the reader: moto's set-up key is refused now


def test_data_prep_checks_it_may_write_before_it_reads(s3_with_iam, tmp_path):
    """A read-only identity: data prep says so before reading the source, and creates nothing."""
    source = tmp_path / "d.csv"
    source.write_text("x,label\n" + "".join(f"{i},{i % 2}\n" for i in range(50)))
    prep = cli_args(source_uri=source, output="s3://t-iam/prepared", label="label")
    proc = run_cli("data", "prep", *prep, env=s3_with_iam.reader_env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "Cannot write the prepared data to s3://t-iam/prepared" in proc.stderr and "s3:PutObject" in proc.stderr
