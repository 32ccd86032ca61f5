"""What a URI names, from its text alone: a local path, or a store and its scheme. Below both the atomic
writes (util/atomic.py) and the stores' errors and copies (util/storage.py), which use it."""

from __future__ import annotations


def local_path(uri: str) -> str | None:
    """The local path a URI names, or None for a remote one (gs://, s3://, memory://, ...)."""
    if uri.startswith("file://"):
        return uri[len("file://") :]
    return None if "://" in uri else uri


def scheme(uri: str) -> str:
    return uri.split("://", 1)[0] if "://" in uri else "file"
