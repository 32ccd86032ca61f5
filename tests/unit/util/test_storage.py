"""util/storage.py: what a storage error tells the user, and a folder copied with its marker last."""

from __future__ import annotations

import botocore.exceptions
import google.auth.exceptions
import pytest

from elastic_step.util.storage import copy_folder, explain

# The exceptions gcsfs and s3fs raise, as they raise them (see gcsfs.retry.validate_response and
# s3fs.errors.translate_boto_error).
CASES = [
    (
        "gs://b/x",
        google.auth.exceptions.DefaultCredentialsError("Could not automatically determine credentials"),
        "GOOGLE_APPLICATION_CREDENTIALS",
    ),
    (
        "gs://b/x",
        OSError("Forbidden: b/x\nAnonymous caller does not have storage.objects.get access"),
        "Workload Identity",
    ),
    (
        "gs://b/x",
        OSError("Forbidden: b/x\nsa@p.iam does not have storage.objects.create access"),
        "roles/storage.objectAdmin",
    ),
    ("gs://b/x", FileNotFoundError("b/x"), "gcloud storage buckets create"),
    ("s3://b/x", botocore.exceptions.NoCredentialsError(), "AWS_ACCESS_KEY_ID"),
    ("s3://b/x", PermissionError("The AWS Access Key Id you provided does not exist (InvalidAccessKeyId)"), "refused"),
    ("s3://b/x", PermissionError("Access Denied"), "s3:PutObject"),
    ("s3://b/x", PermissionError("Forbidden"), "refused the step's AWS credentials"),  # a HEAD's bare 403
    ("s3://b/x", PermissionError("Forbidden"), "s3:PutObject"),
    ("s3://b/x", FileNotFoundError("The specified bucket does not exist"), "aws s3 mb"),
]


@pytest.mark.parametrize("uri, error, fix", CASES)
def test_each_kind_of_storage_error_is_one_paragraph_with_the_uri_and_its_fix(uri, error, fix, monkeypatch):
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    message = explain(uri, error, "write the model to")
    assert message.startswith(f"Cannot write the model to {uri}: ")
    assert fix in message
    assert "\n" not in message


def test_a_missing_key_file_is_named_not_taken_for_a_permission(monkeypatch, tmp_path):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "key.json"))
    message = explain(
        "gs://b/x", OSError("Forbidden: Anonymous caller does not have storage.objects.get access"), "read"
    )
    assert str(tmp_path / "key.json") in message and "does not exist" in message


def test_a_folder_is_copied_with_its_marker_last_and_the_old_marker_gone_first(tmp_path):
    import fsspec

    src = tmp_path / "src"
    (src / "saved_model").mkdir(parents=True)
    (src / "saved_model" / "saved_model.pb").write_bytes(b"pb")
    (src / "model.keras").write_bytes(b"new")
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/dest/model.keras", b"old")
    order = []
    put = fs.open

    def watching(path, mode="rb", **kw):
        if "w" in mode:
            order.append((path, fs.exists("/dest/model.keras")))
        return put(path, mode, **kw)

    fs.open = watching
    try:
        copy_folder(str(src), "memory://dest", last="model.keras")
    finally:
        del fs.open
    assert [p for p, _ in order] == ["/dest/saved_model/saved_model.pb", "/dest/model.keras"]
    assert order[0][1] is False  # the old marker was gone before anything new landed
    assert fs.cat_file("/dest/model.keras") == b"new"
    fs.rm("/dest", recursive=True)
