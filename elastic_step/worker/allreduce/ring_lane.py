"""A shared-memory lane between two ring neighbours on one host: the sender's output buffer itself.

Over loopback TCP the kernel copies every payload byte twice (into the socket, out of it), and on a
small machine memory traffic, not the ring, bounds the AllReduce. When both neighbours see the same
/dev/shm (local processes; not pods, each of which has its own), the sender's allreduce output lives in a
shared segment, and the receiver reads each piece where the sender left it: it adds the piece to its own
values (reduce-scatter) or copies it (all-gather). Moving a piece copies nothing. The TCP connection
stays: it carries each frame's header, the lane's growth, and either side's death.

The sender creates the segment (util/shared_memory.py) and names it in its hello; the receiver opens
it, maps it and unlinks it at once, and the sender unlinks it too once answered: the memory lives only
while a side holds it, and a killed process leaks nothing. Both keep the file open: when a larger
buffer comes, the sender grows it and says so in the stream (a frame ring_transport.LANE_GROWN) before
any frame that lies beyond the old end, and the receiver maps it again. A receiver that cannot open it
(another host, another pod) answers so, and the link carries its payloads over TCP.

A piece must stay as it is until the receiver has taken it. Within a step the one place written again
after the right neighbour may have read it is the member's own chunk: sent first as it is, it comes
back summed only after that neighbour has added to it (the ring's order makes it so). Across steps, no
acknowledgement is needed: each step's buffer is placed clear of wherever the receiver may still be
reading (`claim`), and a step that succeeds proves the receiver is done with every earlier one, since
the ring brings back values the receiver could only send once it had finished reading them. So two
buffers' worth of lane do, plus one per attempt aborted since the last success. The buffer the
allreduce returns is in this segment (or in the ring's shared result, ring_result.py, when every link
of the ring is a lane): it holds at least until the link's next allreduce.
"""

from __future__ import annotations

import logging
import mmap
import os

import numpy as np

from elastic_step.util import shared_memory

log = logging.getLogger("elastic_step.worker")

INITIAL_BYTES = 4 << 20
GROW_BYTES = 4 << 20  # a lane grows in whole steps of this


class Lane:
    """One side's open file and mapping of a lane's segment."""

    def __init__(self, fd: int, path: str, nbytes: int):
        self.fd, self.path = fd, path
        self.values = np.empty(0, np.float32)
        self._read: list[tuple[int, int]] = []  # the sender's: the places the receiver may still read
        self._map(nbytes)

    def _map(self, nbytes: int) -> None:
        # A view keeps its mapping alive: a result handed out before the lane grew stays readable.
        self.values = np.frombuffer(mmap.mmap(self.fd, nbytes), np.float32)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes

    @classmethod
    def create(cls, directory: str = shared_memory.SHM_DIR, nbytes: int = INITIAL_BYTES) -> Lane | None:
        """A new segment, or None where this host gives no shared memory (then the link uses TCP)."""
        try:
            return cls(*shared_memory.create_file("ring", nbytes, directory), nbytes)
        except shared_memory.SharedMemoryUnavailable as e:
            log.info("ring lane: %s: payloads go over TCP", e)
            return None

    @classmethod
    def attach(cls, name: str, keep_name: bool = False) -> Lane | None:
        """The sender's lane named `name` under /dev/shm, opened, mapped and unlinked (unless `keep_name`:
        ring_result.py's segment, which more members open); None if this side cannot see it (the sender
        is on another host or in another pod)."""
        if not name.startswith(f"{shared_memory.PREFIX}ring-"):
            return None  # another of our segments, or not ours
        path = os.path.join(shared_memory.SHM_DIR, name)
        try:
            fd = shared_memory.open_file(path)
        except ValueError:
            return None
        try:
            lane = cls(fd, path, os.fstat(fd).st_size)
        except (OSError, ValueError):
            os.close(fd)
            return None
        if not keep_name:
            lane.unlink()
        return lane

    def claim(self, values: int) -> tuple[int, bool]:
        """The sender's side: where a step's `values` float32 values go, clear of every place the receiver
        may still be reading (the earlier attempts' since the last that succeeded), growing the segment if
        need be. (origin, whether it grew: the receiver must be told). Raises SharedMemoryUnavailable (a
        full /dev/shm)."""
        origin = 0
        for start, end in sorted(self._read):
            if origin + values <= start:
                break
            origin = max(origin, end)
        grew = self._reserve(origin + values)
        self._read.append((origin, origin + values))
        return origin, grew

    def settled(self) -> None:
        """The sender's side: the step last claimed succeeded, so the receiver is done with every earlier one."""
        del self._read[:-1]

    def _reserve(self, values: int) -> bool:
        if 4 * values <= self.nbytes:
            return False
        nbytes = -(-4 * values // GROW_BYTES) * GROW_BYTES
        shared_memory.reserve(self.fd, nbytes)
        self._map(nbytes)
        return True

    def grown(self, nbytes: int) -> None:
        """The receiver's side: the sender grew the segment to `nbytes`. Raises ValueError if it did not."""
        held = os.fstat(self.fd).st_size
        if held < nbytes:
            raise ValueError(f"the lane holds {held} bytes, not the {nbytes} its sender announced")
        self._map(nbytes)

    def piece(self, offset: int, count: int) -> np.ndarray:
        """The `count` values at `offset`. Raises ValueError outside the lane."""
        if offset < 0 or count < 0 or offset + count > self.values.size:
            raise ValueError(f"values [{offset}, {offset + count}) lie outside the lane's {self.values.size}")
        return self.values[offset : offset + count]

    def unlink(self) -> None:
        shared_memory.unlink(self.path)

    def close(self) -> None:
        """Closes the file; the mapping goes with the last view of it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
