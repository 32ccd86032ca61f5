"""A shared-memory lane between two ring neighbours on one host.

Over loopback TCP every payload byte is copied twice by the kernel (into the socket, out of it), and on a
small machine those copies, not the ring, bound the AllReduce. When both neighbours see the same /dev/shm
(local processes; not pods, each of which has its own), payloads go through a shared file instead:
the sender copies a piece into it once and the receiver adds straight from it. The TCP connection stays:
it carries each frame's header, the receiver's credits back, and either side's death, as before.

The sender creates the segment (util/shared_memory.py) and names it in its hello. The receiver maps it
and unlinks it at once, and the sender unlinks it too once answered: the memory lives only while a side
maps it, and a killed process leaks nothing. A receiver that cannot open it (another host, another pod)
answers so, and the link carries its payloads over TCP.

Payloads lie one after another in a circular region; one that would cross its end starts at 0 instead
(the skipped tail counts as used). Both sides compute the same positions from the frames' sizes, in
order. The receiver reports the bytes it has finished with (a running total) whenever it has freed
CREDIT_BYTES more, and the sender waits for room; a frame is at most MAX_FRAME_BYTES, so the room a
sender waits for is always given back by a receiver that has taken every frame sent.
"""
from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
from typing import Callable

import numpy as np

from elastic_step.util import shared_memory

log = logging.getLogger("elastic_step.worker")

LANE_BYTES = 16 << 20
CREDIT_BYTES = LANE_BYTES // 4      # a credit is a loopback send, which wakes the sender: not one per frame
MAX_FRAME_BYTES = LANE_BYTES // 8
CREDIT = struct.Struct("<q")        # the receiver's running total of bytes taken


class Lane:
    """One side's mapping of a lane's segment."""

    def __init__(self, mm: mmap.mmap, path: str):
        self.path = path
        self.bytes = np.frombuffer(mm, np.uint8)    # the mapping lives as long as a view of it

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @classmethod
    def create(cls, directory: str = shared_memory.SHM_DIR) -> Lane | None:
        """A new lane, or None where this host gives no shared memory (then the link uses TCP)."""
        try:
            return cls(*shared_memory.create("ring", LANE_BYTES, directory))
        except shared_memory.SharedMemoryUnavailable as e:
            log.info("ring lane: %s: payloads go over TCP", e)
            return None

    @classmethod
    def attach(cls, name: str) -> Lane | None:
        """The sender's lane named `name` under /dev/shm, mapped and unlinked; None if this side cannot see
        it (the sender is on another host or in another pod)."""
        if not name.startswith(f"{shared_memory.PREFIX}ring-"):
            return None                 # another of our segments, or not ours
        path = os.path.join(shared_memory.SHM_DIR, name)
        try:
            lane = cls(shared_memory.open_segment(path, LANE_BYTES), path)
        except ValueError:
            return None
        lane.unlink()
        return lane

    def unlink(self) -> None:
        shared_memory.unlink(self.path)


def _place(total: int, nbytes: int) -> tuple[int, int]:
    """(where a payload of `nbytes` starts, the running total once it is placed) after `total` bytes."""
    pos = total % LANE_BYTES
    if pos + nbytes > LANE_BYTES:
        total += LANE_BYTES - pos
        pos = 0
    return pos, total + nbytes


class LaneWriter:
    """The sender's side: places each payload and waits for the room the receiver gives back."""

    def __init__(self, lane: Lane, sock: socket.socket):
        self.lane, self.sock = lane, sock
        self.placed = 0                  # running total of bytes placed, skipped tails included
        self.freed = 0                   # the receiver's last credit
        self._credits = bytearray()

    @staticmethod
    def check(values: np.ndarray) -> None:
        """Raises ValueError for a frame the lane cannot take (before it is queued)."""
        if values.nbytes > MAX_FRAME_BYTES:
            raise ValueError(f"a ring frame of {values.nbytes} bytes is larger than a lane's "
                             f"{MAX_FRAME_BYTES}: send smaller pieces")

    def put(self, values: np.ndarray, closed: Callable[[], bool]) -> None:
        """Copies `values` (`check`ed) into the lane once there is room. Raises OSError if the receiver is
        gone or `closed()` says the link is closing."""
        data = values.view(np.uint8)
        pos, after = _place(self.placed, data.size)
        while after - self.freed > LANE_BYTES:
            if closed():
                raise OSError("link closed")
            self._read_credits()
        np.copyto(self.lane.bytes[pos:pos + data.size], data)
        self.placed = after

    def _read_credits(self) -> None:
        try:
            part = self.sock.recv(4096)
        except (BlockingIOError, socket.timeout):    # none for POLL_S: the caller looks again
            return
        if not part:
            raise OSError("the receiver closed the ring connection")
        self._credits += part
        whole = len(self._credits) - len(self._credits) % CREDIT.size
        if whole:
            self.freed = CREDIT.unpack_from(self._credits, whole - CREDIT.size)[0]
            del self._credits[:whole]


class LaneReader:
    """The receiver's side: where each frame's payload is, and the credits it sends back."""

    def __init__(self, lane: Lane, sock: socket.socket):
        self.lane, self.sock = lane, sock
        self.taken = 0
        self.credited = 0

    def take(self, count: int) -> np.ndarray:
        """The next frame's `count` float32 values, in the lane: use them, then `credit`."""
        pos, self.taken = _place(self.taken, 4 * count)
        return self.lane.bytes[pos:pos + 4 * count].view(np.float32)

    def credit(self) -> None:
        """Gives the room taken so far back, in batches. Raises OSError if the sender is gone."""
        if self.taken - self.credited >= CREDIT_BYTES:
            self.sock.sendall(CREDIT.pack(self.taken))
            self.credited = self.taken
