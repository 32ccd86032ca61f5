"""A frozen parameter server (master/gray/ps_watch.py): the master's probe, over real gRPC, finds a shard that stops
answering; the shard's clock and bound are master/gray/hang.py's, and a silent shard holds the workers' clocks."""

from __future__ import annotations

import time

import pytest

from elastic_step.backends.api import InstanceId
from elastic_step.master.gray import ps_watch
from elastic_step.master.gray.hang import HangBounds
from elastic_step.master.gray.ps_watch import PSWatch
from elastic_step.master.leases.coordinator import Coordinator
from elastic_step.master.leases.ledger import Ledger, ShardInfo
from tests.unit.ps.frozen_shard import FrozenShard, serving


@pytest.fixture
def shard():
    servicer = FrozenShard()
    with serving(servicer) as address:
        yield servicer, address


def until(watch: PSWatch, seconds: float, done=lambda late: bool(late)) -> list:
    """Tick the watch as the pump does (every 0.1 s) until `done(late)` or `seconds` pass."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        late = watch.hung(time.time())
        if done(late):
            return late
        time.sleep(0.1)
    return []


def test_a_shard_that_stops_answering_is_hung_after_its_bound_and_holds_the_workers_clocks_meanwhile(shard):
    servicer, address = shard
    coord = Coordinator(Ledger([ShardInfo("s", 1000)], 100, 1, 10), num_ps=1)
    coord.register(InstanceId("ps", 0), address)
    watch = PSWatch(coord, "token", HangBounds(timeout_s=1.5), every_s=0.1)
    watch.start()
    try:
        assert until(watch, 2.0) == []  # it answers: never late
        assert servicer.briefs > 5 and watch.hangs.idle("ps-0") is not None  # probed brief, and its clock runs
        assert not watch.silent(time.time())
        servicer.frozen.set()
        late = until(watch, 10.0)
        assert [(h.worker, h.bound_s, h.what) for h in late] == [("ps-0", 1.5, "answer")]
        assert str(late[0]).startswith("no answer for") and "(bound 1.5 s, --hang-timeout)" in str(late[0])
        assert late[0].idle_s > 1.5
        deadline = time.time() + ps_watch.SILENT_S + 2
        while not watch.silent(time.time()):  # the workers' clocks hold: their pushes wait on it
            assert time.time() < deadline, "a shard silent for longer than SILENT_S does not hold the workers' clocks"
            time.sleep(0.1)
        watch.declare_hung(late[0], time.time())
        event = coord.timeline.events[-1]
        assert (event["kind"], event["instance"], event["bound_s"]) == ("hung", "ps-0", 1.5) and event["idle_s"] >= 1.5
        assert "declared hung, killed" in event["detail"] and not watch.silent(time.time())
        # The restore: the address goes, no clock runs (rewinding); the relaunched shard's clock starts afresh.
        with coord.lock:
            coord.rewinding, coord.ps_addresses[0] = True, ""
        servicer.frozen.clear()
        assert until(watch, 1.0) == []
        with coord.lock:
            coord.rewinding, coord.ps_addresses[0] = False, address
        assert until(watch, 1.5) == [] and watch.hangs.idle("ps-0") is not None
    finally:
        watch.close()
