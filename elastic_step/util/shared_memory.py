"""Segments under /dev/shm that two processes on one host map: the PS's push slots, the ring's lanes.

One side creates the file (O_EXCL, mode 0600, its pages reserved up front: a full tmpfs then fails
here with ENOSPC instead of a SIGBUS on the first write into the mapping) and sends its path; the other
maps it; the file is unlinked as soon as both have, so nothing is left behind when either process dies.
A side that cannot open the path (another host, another pod's /dev/shm) falls back to sending bytes.
"""

from __future__ import annotations

import mmap
import os
import secrets

SHM_DIR = "/dev/shm"
PREFIX = "elastic-step-"


class SharedMemoryUnavailable(Exception):
    """This host gives no shared memory here (no /dev/shm, or it is full)."""


def create(tag: str, size: int, directory: str = SHM_DIR) -> tuple[mmap.mmap, str]:
    """A new segment of `size` bytes, mapped: (mapping, path). Raises SharedMemoryUnavailable."""
    fd, path = create_file(tag, size, directory)
    try:
        return mmap.mmap(fd, size), path
    finally:
        os.close(fd)


def create_file(tag: str, size: int, directory: str = SHM_DIR) -> tuple[int, str]:
    """A new segment of `size` bytes, open: (file descriptor, path), for a side that keeps the file to grow
    it (`reserve`). Raises SharedMemoryUnavailable."""
    path = os.path.join(directory, f"{PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise SharedMemoryUnavailable(f"cannot create {path}: {e.strerror}") from e
    try:
        reserve(fd, size, directory)
    except SharedMemoryUnavailable:
        os.close(fd)
        unlink(path)
        raise
    return fd, path


def reserve(fd: int, size: int, directory: str = SHM_DIR) -> None:
    """Makes an open segment `size` bytes long, its pages reserved. Raises SharedMemoryUnavailable."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        raise SharedMemoryUnavailable(f"cannot reserve {size} bytes in {directory}: {e.strerror}") from e


def open_segment(path: str, size: int) -> mmap.mmap:
    """Maps a segment another process created; raises ValueError (the reason) when it is not one of
    ours under SHM_DIR of `size` bytes, or this process cannot see it."""
    fd = open_file(path)
    try:
        held = os.fstat(fd).st_size
        if held != size:
            raise ValueError(f"{path} holds {held} bytes, not {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def open_file(path: str) -> int:
    """Opens a segment another process created, for a side that keeps the file (to map it again when the
    creator grows it); raises ValueError (the reason) when it is not one of ours under SHM_DIR, or this
    process cannot see it."""
    if os.path.dirname(os.path.abspath(path)) != SHM_DIR or not os.path.basename(path).startswith(PREFIX):
        raise ValueError(f"{path!r} is not an elastic-step segment under {SHM_DIR}")
    try:
        return os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # the creator made a file, not a link
    except OSError as e:  # another host or pod: its /dev/shm is not ours
        raise ValueError(f"cannot open {path}: {e.strerror}") from e


def unlink(path: str) -> None:
    """Drops the name; the mappings stay until their last view goes."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
