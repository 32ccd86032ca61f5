"""Atomic writes: write to a sibling temporary name, then rename, so readers never see half a file.

Object stores have no rename; there a single PUT is already atomic, so we write directly.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
import uuid

import fsspec

from elastic_step.util.uri import local_path


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def atomic_write_bytes(uri: str, data: bytes) -> None:
    local = local_path(uri)
    if local is None:
        with fsspec.open(uri, "wb") as f:  # one PUT: atomic on object stores
            f.write(data)
        return
    path = pathlib.Path(local)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; readers may be another user
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(uri: str, text: str) -> None:
    atomic_write_bytes(uri, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike):
    """Yield a temporary sibling folder; on success it replaces `path` in one rename."""
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()
    try:
        yield tmp
        if target.exists():
            old = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.old"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
