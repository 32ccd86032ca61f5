"""The checkpoint store on a real folder: intervals, the watermark, and the members' state written and
read back (or refused, corrupt, with a clear error)."""

from __future__ import annotations

import numpy as np
import pytest

from elastic_step.errors import ConfigError
from elastic_step.master.durability.store import CheckpointError, CheckpointStore, parse_interval
from elastic_step.proto.tensors import MemberState


def test_intervals_are_times_or_records_or_never():
    assert parse_interval("60s") == ("seconds", 60) and parse_interval("5m") == ("seconds", 300)
    assert parse_interval("50000") == ("records", 50000) == parse_interval("50000records")
    assert parse_interval("0") is None
    with pytest.raises(ConfigError, match="--checkpoint-every 'often'"):
        parse_interval("often")


def test_the_watermark_is_this_jobs_only(tmp_path):
    store = CheckpointStore(str(tmp_path / "checkpoints"), {"job_id": "j"})
    assert store.watermark() is None
    store.write_watermark(1234)
    assert store.watermark() == 1234
    assert CheckpointStore(str(tmp_path / "checkpoints"), {"job_id": "another"}).watermark() is None


def test_the_members_state_reads_back_as_written_and_a_corrupt_one_is_a_clear_error(tmp_path):
    store = CheckpointStore(str(tmp_path / "checkpoints"), {"job_id": "j"})
    state = MemberState(
        7,
        1,
        [np.arange(6, dtype=np.float32).reshape(2, 3), np.float32(0.5)],
        {(0, 0): np.array([[0, 64], [128, 192]], np.int64)},
    )
    manifest = store.commit(1, [store.write_members(1, state)], records_committed=192, epoch=0)
    back = store.read_members(manifest)
    assert (back.step, back.num_model) == (7, 1)
    assert [v.tolist() for v in back.values] == [v.tolist() for v in state.values]
    assert {k: v.tolist() for k, v in back.applied.items()} == {(0, 0): [[0, 64], [128, 192]]}
    (tmp_path / "checkpoints" / manifest["files"]["members.npz"]).write_bytes(b"not an npz")
    with pytest.raises(CheckpointError, match="Cannot read the allreduce members' state of checkpoint 1"):
        store.read_members(manifest)
