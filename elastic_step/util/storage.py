"""Object stores (gs://, s3://, any fsspec URI) as a step sees them: where a URI is local, what a
storage error means for the user, and a staged folder's upload with its commit marker last.

Credentials are the stores' standard ones, read by gcsfs and s3fs themselves: for GCS, Application
Default Credentials (GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default login`, GKE's
Workload Identity); for S3, the AWS environment variables, a profile or EKS's IRSA, plus
AWS_ENDPOINT_URL for an S3-compatible store such as the MinIO that Kubeflow Pipelines ships.
"""

from __future__ import annotations

import os
import posixpath
import shutil

import fsspec

from elastic_step.util.atomic import atomic_write_text
from elastic_step.util.uri import local_path, scheme

FIXES = {
    "gs": {
        "credentials": "Give the step Google credentials: GOOGLE_APPLICATION_CREDENTIALS naming a service-account "
        "key file, `gcloud auth application-default login` on a workstation, or on GKE a Kubernetes "
        "service account bound to a Google one with Workload Identity.",
        "refused": "The store refused the step's Google credentials: check that GOOGLE_APPLICATION_CREDENTIALS "
        "names a valid, unexpired key, or that Workload Identity binds the pod's service account.",
        "permission": "The credentials are valid but lack the permission: grant the step's service account "
        "roles/storage.objectAdmin (or objectViewer to read) on the bucket.",
        "bucket": "Create the bucket (`gcloud storage buckets create gs://BUCKET`) or fix the URI.",
    },
    "s3": {
        "credentials": "Give the step AWS credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (a Kubernetes "
        "Secret as environment variables), a profile, or on EKS a service account with IRSA; for "
        "an S3-compatible store such as MinIO also set AWS_ENDPOINT_URL.",
        "refused": "The store refused the step's AWS credentials: check AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL: keys of one store are unknown to another).",
        "permission": "The credentials are valid but lack the permission: allow s3:GetObject, s3:PutObject, "
        "s3:DeleteObject and s3:ListBucket on the bucket for the step's identity.",
        "bucket": "Create the bucket (`aws s3 mb s3://BUCKET`) or fix the URI.",
    },
}
_MISSING_CREDENTIALS = ("DefaultCredentialsError", "NoCredentialsError", "PartialCredentialsError", "Anonymous caller")
_REFUSED = (
    "InvalidAccessKeyId",
    "does not exist in our records",
    "SignatureDoesNotMatch",
    "request signature we calculated does not match",
    "RefreshError",
    "invalid_grant",
    "ExpiredToken",
    "InvalidToken",
    "401",
    "Unauthorized",
)
_DENIED = ("AccessDenied", "Forbidden", "403", "Permission denied", "does not have storage.")
_NO_BUCKET = ("NoSuchBucket", "bucket does not exist", "The specified bucket does not exist")


def protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def on_disk(fs: fsspec.AbstractFileSystem) -> bool:
    """A filesystem of local files (paths that open() and pyarrow can use as they are)."""
    return bool({"file", "local"} & set(protocols(fs)))


def explain(uri: str, e: BaseException, doing: str) -> str:
    """One paragraph for a storage error: what failed (`doing`, e.g. "write the model to"), where, the
    store's own words, and the fix for its kind (credentials missing or refused, a permission, a bucket)."""
    store = {"gcs": "gs", "gs": "gs", "s3": "s3", "s3a": "s3"}.get(scheme(uri))
    fixes = FIXES.get(store, {})
    text = f"{type(e).__name__}: {e}".strip()
    first = text.splitlines()[0][:300]
    if any(k in text for k in _MISSING_CREDENTIALS):
        kind = "credentials"
    elif any(k in text for k in _REFUSED):
        kind = "refused"
    elif text == "PermissionError: Forbidden" and store == "s3":
        kind = "forbidden"  # a HEAD's 403 has no body: unknown credentials and a missing permission look alike
    elif isinstance(e, PermissionError) or any(k in text for k in _DENIED):
        kind = "permission"
    elif any(k in text for k in _NO_BUCKET):
        kind = "bucket"
    elif isinstance(e, FileNotFoundError):
        kind = "missing"
    else:
        kind = "other"
    if kind == "missing":
        fix = "Nothing is there: check the URI" + (
            f"; if the bucket itself is missing: {fixes['bucket']}" if "bucket" in fixes else "."
        )
    elif kind == "forbidden":
        fix = f"{fixes['refused']} If they are right, they lack the permission: {fixes['permission'].split(': ', 1)[1]}"
    elif kind in fixes:
        fix = fixes[kind]
    elif store is None and "://" in uri and kind == "other":
        fix = (
            f"Check the URI; {scheme(uri)}:// needs its fsspec filesystem installed "
            "(gcsfs for gs://, s3fs for s3://, which `pip install elastic-step[s3]` adds)."
        )
    else:
        fix = "Check the URI, and that the step's credentials may use it."
    key = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if store == "gs" and key and not os.path.isfile(key) and kind in ("credentials", "refused", "permission"):
        # gcsfs falls back to anonymous access when the key file is missing: say so, not "permission".
        fix = (
            f"GOOGLE_APPLICATION_CREDENTIALS names {key}, which does not exist, so the step ran without "
            "credentials. Mount the key file there (a Kubernetes Secret as a volume) or unset it."
        )
    return f"Cannot {doing} {uri}: {first.rstrip('.')}. {fix}"


def check_writable(uri: str, doing: str, error: type[Exception], alternative: str = "") -> None:
    """At a job's start, not at its end: write and delete a probe under `uri` (a folder). `alternative`
    ends the error's paragraph: a way to run without writing there, if there is one."""
    probe = f"{uri.rstrip('/')}/.elastic-step-probe"
    try:
        atomic_write_text(probe, "elastic-step probe\n")
        fs, path = fsspec.core.url_to_fs(probe)
        fs.rm(path)
    except Exception as e:  # noqa: BLE001 - any storage error: one clear paragraph
        raise error(" ".join(filter(None, (explain(uri, e, doing), alternative)))) from None


def copy_folder(source: str | os.PathLike, uri: str, last: str | None = None) -> None:
    """Copy every file under `source` (a local folder or any URI) under `uri`, `last` (a relative path,
    the readers' commit marker) after every other file, and `last`'s old copy removed first: until the new
    one lands, no marker points at a mix of old and new files (object stores have no rename)."""
    src_fs, src_root = fsspec.core.url_to_fs(str(source))
    src_root = src_root.rstrip("/")
    fs, root = fsspec.core.url_to_fs(uri)
    root = root.rstrip("/")
    local = local_path(uri) is not None
    if last is not None and fs.exists(f"{root}/{last}"):
        fs.rm(f"{root}/{last}")
    files = sorted(posixpath.relpath(p, src_root) for p in src_fs.find(src_root))
    for rel in sorted(files, key=lambda r: r == last):
        dest = f"{root}/{rel}"
        if local:  # an object store has no folders (and s3fs's makedirs would create a missing bucket)
            fs.makedirs(posixpath.dirname(dest), exist_ok=True)
        with src_fs.open(f"{src_root}/{rel}", "rb") as r, fs.open(dest, "wb") as w:
            shutil.copyfileobj(r, w, 8 << 20)
