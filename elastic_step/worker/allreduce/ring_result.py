"""A ring's shared result: one segment that every member of a ring on one host maps, so that the
all-gather copies nothing.

Through lanes (ring_lane.py) each member still ends with a copy of the whole result in its own lane:
the all-gather copies every chunk into every member, a third of a step's memory traffic with 3
members. When every link of the ring is a lane, the members share one buffer instead. Each chunk is
reduced in place there: the member that adds its values to a chunk writes it where its left
neighbour's partial sum lies. Once final, the chunk is already in every member's result, and the
all-gather's frames only say that it is.

How the segment goes round. At a version's first step the ring's first member creates it and names it
to its right neighbour in the stream (ring_transport.RESULT_SHARED). Each member that receives the
name maps the segment and names it on, if its own right link is a lane. When the name comes back to
its creator, every member has the segment open and the creator unlinks it: from then on it lives while
a member holds it. (A creator killed in between, within a version's first step, leaves the file under
/dev/shm; a lane, unlinked once its hello is answered, has no such window.) A member whose right link
is TCP keeps it to itself, and so do those after it: they work in their lanes as before. A member in
the segment and one in its lane work together, since each frame says where its piece lies. A new
version (a member lost or added) starts again with a new segment.

Where a step's result lies. Members that use the segment must all put a step at the same place, and
never where a member may still be reading the previous step's result. So the segment holds two
buffers, and step s uses buffer s % 2, but only when this member's last step that succeeded was s - 1
of the same version. All members run the same steps, so all decide alike; otherwise the member works
in its lane. A member that begins step s has seen step s - 1 succeed, which needed every member to
have begun step s - 1: none still reads step s - 2's result, the one that buffer held.
"""

from __future__ import annotations

import numpy as np

from elastic_step.worker.allreduce.ring_lane import Lane


class SharedResult:
    """This member's hold on its ring's shared result, for one membership version."""

    def __init__(self, segment: Lane, version: int, values: int, created: bool):
        self.segment, self.version, self.values = segment, version, values  # `values`: per buffer
        self.created = created  # this member made it: it unlinks it when the name comes back
        self.named_to = None  # the OutLink to the right neighbour that was told of it, if any

    @property
    def name(self) -> str:
        return self.segment.name

    @classmethod
    def create(cls, version: int, values: int) -> SharedResult | None:
        """A new segment of two buffers of `values` float32 values; None where there is no shared memory."""
        segment = Lane.create(nbytes=2 * 4 * values)
        return None if segment is None else cls(segment, version, values, created=True)

    def name_to(self, right) -> None:
        """Names the segment to the right neighbour (an OutLink through a lane): from the next step on,
        this member's result may lie in it."""
        right.name_result(self.version, self.values, self.name)
        self.named_to = right

    def buffer(
        self, key: tuple[int, int], succeeded: tuple[int, int], right, size: int
    ) -> tuple[np.ndarray, int] | None:
        """Step `key`'s result buffer of `size` values (view, origin), if this step may use the segment:
        its buffers hold `size` values, `succeeded`, this member's last step that succeeded, is the one
        before it, and the right neighbour, `right`, was told of the segment. None: the step works in the
        lane."""
        version, step = key
        if (
            size != self.values
            or self.named_to is not right
            or version != self.version
            or succeeded != (version, step - 1)
        ):
            return None
        origin = (step % 2) * self.values
        return self.segment.values[origin : origin + self.values], origin

    def unlink(self) -> None:
        """The creator's: drops the name, once it has come back round the ring (every member has the
        segment open) or when this member lets go of it first."""
        if self.created:
            self.segment.unlink()
            self.created = False

    def close(self) -> None:
        self.unlink()
        self.segment.close()  # unmapped once no view of it is left
