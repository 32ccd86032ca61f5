"""The checkpoint cutter on a real coordinator and a real folder: the barrier, the manifest as the
commit point, and the previous checkpoint kept until then."""

from __future__ import annotations

import json

import pytest

from elastic_step.backends.api import InstanceId
from elastic_step.fault_hooks import NO_FAULTS, JobFaults
from elastic_step.master.durability.checkpoint import Checkpointer
from elastic_step.master.durability.store import CheckpointStore
from elastic_step.master.leases.coordinator import Coordinator
from elastic_step.master.leases.ledger import Ledger, ShardInfo


def cutter(tmp_path, parts_written: list, seen: list | None = None):
    """`seen`: per checkpoint, whether the workers were held when its state was taken, and when it was written."""
    seen = [] if seen is None else seen
    coord = Coordinator(Ledger([ShardInfo("s", 64)], 16, 2, 16), num_ps=1)
    store = CheckpointStore(str(tmp_path / "checkpoints"), {"job_id": "j"})

    def parts(ckpt_id):
        taken_held = coord.holding

        def write():
            parts_written.append(ckpt_id)
            seen.append({"taken_held": taken_held, "written_held": coord.holding})
            (tmp_path / "checkpoints" / f"ckpt-{ckpt_id:06d}").mkdir(parents=True, exist_ok=True)
            (tmp_path / "checkpoints" / f"ckpt-{ckpt_id:06d}" / "ps-0.npz").write_bytes(b"state")
            return ["ps-0.npz"]

        return write

    def state():
        return {"ledger": coord.ledger.cut(), "ledger_records_committed": coord.ledger.records_committed_total()}

    return coord, store, Checkpointer(store, ("records", 16), coord, parts, state)


def test_nothing_is_cut_before_every_shard_registered_nor_before_the_barrier_holds(tmp_path):
    written: list = []
    coord, store, c = cutter(tmp_path, written)
    ledger = coord.ledger
    lease = ledger.lease("worker-0", 0.0)
    ledger.report("worker-0", lease.task.task_id, lease.task.end)  # 16 records: one is due
    c.tick(16, 0.0)
    assert not coord.holding and written == []  # the shards are not all up
    coord.ps_ready.set()
    lease = ledger.lease("worker-0", 0.0)
    c.tick(16, 0.0)
    assert coord.holding and written == []  # worker-0 still holds a lease
    coord.held.add("worker-0")
    c.tick(16, 0.0)
    assert written == [1] and not coord.holding
    manifest = store.latest()
    assert manifest["id"] == 1 and manifest["records_committed"] == 16
    size = sum(f.stat().st_size for f in (tmp_path / "checkpoints" / "ckpt-000001").iterdir())
    assert c.written[-1]["bytes"] == size > len(b"state")  # its parts, the ledger's cut among them
    cut = store.read_json(manifest, "ledger.json")["ledger"]
    assert [lease.task.task_id, lease.watermark] in cut["queue"]  # the held lease goes back


def test_the_cut_is_taken_while_the_workers_are_held_and_written_after_they_go_on(tmp_path):
    """The shards' states and the ledger's cut are taken at the same pushes (every worker held); the files are
    written once the workers go on, so a checkpoint holds them only as long as taking its state does."""
    written, seen = [], []
    coord, store, c = cutter(tmp_path, written, seen)
    coord.ps_ready.set()
    ledger = coord.ledger
    lease = ledger.lease("worker-0", 0.0)
    ledger.report("worker-0", lease.task.task_id, lease.task.end)
    c.tick(16, 0.0)
    coord.held.add("worker-0")
    c.tick(16, 0.0)
    assert seen == [{"taken_held": True, "written_held": False}]
    assert store.latest()["records_committed"] == 16 and c.written[-1]["held_s"] >= 0


class MasterDiesMidCheckpoint(JobFaults):
    def checkpoint_written(self, ckpt_id: int) -> None:
        raise RuntimeError("the master dies here")


def test_the_manifest_is_the_commit_point_and_the_previous_checkpoint_stays_until_it(tmp_path):
    written: list = []
    coord, store, c = cutter(tmp_path, written)
    coord.ps_ready.set()
    c.tick(16, 0.0)
    c.tick(16, 0.0)
    c.faults = MasterDiesMidCheckpoint()
    c.tick(32, 0.0)
    with pytest.raises(RuntimeError):
        c.tick(32, 0.0)
    assert store.latest()["id"] == 1  # checkpoint 2 never committed
    assert (tmp_path / "checkpoints" / "ckpt-000001" / "ps-0.npz").exists()
    assert (
        json.loads((tmp_path / "checkpoints" / "checkpoint.json").read_text())["files"]["ps-0.npz"]
        == "ckpt-000001/ps-0.npz"
    )
    c.faults = NO_FAULTS
    c.tick(48, 0.0)
    c.tick(48, 0.0)
    assert store.latest()["id"] == 2
    assert not (tmp_path / "checkpoints" / "ckpt-000001").exists()  # gone only after 2 committed


def test_the_last_cut_is_taken_at_once_and_keeps_the_workers_held(tmp_path):
    """On SIGTERM: one more checkpoint, not waiting for the interval, and no worker released after it
    (whatever it trained next would be lost with the step)."""
    written, seen = [], []
    coord, store, c = cutter(tmp_path, written, seen)
    coord.ps_ready.set()
    c.every = ("seconds", 3600.0)
    ledger = coord.ledger
    lease = ledger.lease("worker-0", 0.0)
    ledger.report("worker-0", lease.task.task_id, lease.task.end)
    c.tick(16, 0.0)
    assert not coord.holding  # not due for an hour
    c.last = True
    c.tick(16, 0.0)
    assert coord.holding and written == []
    coord.held.add("worker-0")
    c.tick(16, 0.0)
    assert written == [1] and store.latest()["records_committed"] == 16
    assert seen == [{"taken_held": True, "written_held": True}]  # held while it is written, and after
    assert coord.holding and not coord.hold(InstanceId("worker", 0), wait_s=0.01)  # still held


def test_a_shard_lost_before_the_master_knows_abandons_the_checkpoint_not_the_job(tmp_path):
    """CI found it: a PS pod deleted, workers dropped their leases (their pushes failed), the barrier
    held at once and Save met the dead shard before the pod's end was reported."""
    import grpc

    class Unavailable(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "failed to connect to all addresses"

    written: list = []
    coord, store, c = cutter(tmp_path, written)
    coord.ps_ready.set()
    c.tick(16, 0.0)
    c.write_now()  # checkpoint 1
    healthy, c._parts = c._parts, lambda ckpt_id: (_ for _ in ()).throw(Unavailable())
    c.tick(32, 0.0)
    c.tick(32, 0.0)  # the barrier holds: Save fails
    assert c.abandoned == 1 and not coord.holding and store.latest()["id"] == 1
    c._parts = healthy
    c.tick(40, 0.0)
    assert not coord.holding  # the next try is an interval later
    c.tick(64, 0.0)
    c.tick(64, 0.0)
    assert store.latest()["id"] == 2  # the same id, once the shards are back
    c._parts = lambda ckpt_id: (_ for _ in ()).throw(ValueError("a bug"))
    c.tick(96, 0.0)
    with pytest.raises(ValueError):  # anything else is not swallowed
        c.tick(96, 0.0)
