"""Push slots in shared memory, for a worker and a PS shard on one host (the local backend).

A push's dense gradient and the fresh values it brings back are a shard's whole flat buffer each
way. Through gRPC that is ~10 copies, page faults and socket work per push, all of it CPU taken
from the training step. When both ends share a host, the worker writes the gradient into a slot of
a segment the shard has mapped too, the shard writes its fresh values back into the same slot, and
only the small keyed PushRequest crosses the socket. Exactly-once is unchanged: the key still
travels in the request and the shard still applies it at most once.

The segment is a file under /dev/shm (util/shared_memory.py) that the worker creates and unlinks as
soon as the shard has mapped it, so nothing is left behind when either process dies. A shard that
cannot map it (another host, another pod's /dev/shm) refuses, and that worker's pushes carry their
bytes in the message.
"""

from __future__ import annotations

import collections
import hmac
import mmap
import secrets
import threading

import numpy as np

from elastic_step.util.shared_memory import SHM_DIR, SharedMemoryUnavailable, create, open_segment, unlink

__all__ = ["SHM_DIR", "SharedMemoryUnavailable", "PushSlots", "SharedSegments"]

HEADER = 64  # bytes before the first slot: the nonce that proves it is our segment
NONCE = 16
MAX_SEGMENTS = 64  # per shard; the least recently used is dropped (a lost worker's)


def _layout(floats: int, slots: int, minibatches: int = 1, state_words: int = 0) -> int:
    return HEADER + slots * _slot_words(floats, minibatches, state_words) * 4


def _slot_words(floats: int, minibatches: int, state_words: int) -> int:
    return minibatches * floats + max(floats, state_words)


class PushSlots:
    """The worker's side: `slots` slots, each [gradients | fresh values]: room for the gradients of
    `minibatches` minibatches (a push of several, one after another), and one set of values, each
    `floats` float32. `state_words`: the values part is that long, to carry a copy's whole state
    (ParameterShard.words) to the shard; the fresh values come back in its first `floats`."""

    def __init__(self, floats: int, slots: int, tag: str, minibatches: int = 1, state_words: int = 0):
        self.floats = floats
        self.minibatches = minibatches
        self.state_words = state_words
        self.size = _layout(floats, slots, minibatches, state_words)
        self.nonce = secrets.token_bytes(NONCE)
        self._map, self.path = create(tag, self.size)
        self._map[:NONCE] = self.nonce

    def gradient(self, slot: int) -> np.ndarray:
        return _view(self._map, self.floats, self.minibatches, self.state_words, slot, 0)

    def values(self, slot: int) -> np.ndarray:
        return _view(self._map, self.floats, self.minibatches, self.state_words, slot, 1)

    def state(self, slot: int) -> np.ndarray:
        return _view(self._map, self.floats, self.minibatches, self.state_words, slot, 2)

    def unlink(self) -> None:
        """Drop the name (the mappings stay): called once the shard has mapped it, and on close."""
        unlink(self.path)

    def close(self) -> None:
        self.unlink()
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass


class SharedSegments:
    """The shard's side: the segments workers attached, by id, least recently used dropped first."""

    def __init__(self, max_segments: int = MAX_SEGMENTS):
        self.max_segments = max_segments
        # id -> (mapping, floats, slots, nonce, minibatches, state words)
        self._segments: collections.OrderedDict[int, tuple[mmap.mmap, int, int, bytes, int, int]] = (
            collections.OrderedDict()
        )
        self._next_id = 1
        self._lock = threading.Lock()

    def attach(
        self, path: str, nonce: bytes, floats: int, slots: int, minibatches: int = 1, state_words: int = 0
    ) -> int:
        """Map a worker's segment; raises ValueError (the reason) when it is not one we can use."""
        seg = open_segment(path, _layout(floats, slots, minibatches, state_words))
        if seg[:NONCE] != nonce:
            seg.close()
            raise ValueError(f"{path} is not the segment the worker created (nonce differs)")
        with self._lock:
            seg_id, self._next_id = self._next_id, self._next_id + 1
            self._segments[seg_id] = (seg, floats, slots, nonce, minibatches, state_words)
            while len(self._segments) > self.max_segments:
                self._segments.popitem(last=False)  # unmapped once no push still holds a view of it
        return seg_id

    def detach(self, seg_id: int) -> None:
        with self._lock:
            self._segments.pop(seg_id, None)

    def admits(self, seg_id: int, slot: int, nonce: bytes) -> bool:
        """Whether `nonce` is that of a segment held here, and `slot` one of its slots: only the
        worker that created the segment knows it."""
        with self._lock:
            held = self._segments.get(seg_id)
        return held is not None and 0 <= slot < held[2] and hmac.compare_digest(held[3], nonce)

    def slot(self, seg_id: int, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(gradients, values, state) views of one slot, the gradients [minibatches, floats], the state None
        unless the segment has room for one; KeyError when the segment is unknown or dropped."""
        with self._lock:
            seg, floats, slots, _, minibatches, state_words = self._segments[seg_id]
            self._segments.move_to_end(seg_id)
        if not 0 <= slot < slots:
            raise KeyError(f"slot {slot} of segment {seg_id} (it has {slots})")
        gradients = _view(seg, floats, minibatches, state_words, slot, 0).reshape(minibatches, floats)
        state = _view(seg, floats, minibatches, state_words, slot, 2) if state_words else None
        return gradients, _view(seg, floats, minibatches, state_words, slot, 1), state

    def __len__(self) -> int:
        return len(self._segments)


def _view(buf: mmap.mmap, floats: int, minibatches: int, state_words: int, slot: int, part: int) -> np.ndarray:
    """Part 0 of a slot: its `minibatches` gradients, one after another; part 1: its values; part 2: the
    values part whole (a copy's state, its values first)."""
    offset = HEADER + (slot * _slot_words(floats, minibatches, state_words) + minibatches * floats * bool(part)) * 4
    count = (minibatches * floats, floats, max(floats, state_words))[part]
    return np.frombuffer(buf, np.float32, count, offset)
