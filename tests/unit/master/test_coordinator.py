"""The coordinator's progress samples (the report's and TensorBoard's time series)."""

from __future__ import annotations

import time

from elastic_step.backends.api import EventKind, InstanceEvent, InstanceId
from elastic_step.master.coordinator import Coordinator
from elastic_step.master.ledger import Ledger, ShardInfo

W0, W1 = InstanceId("worker", 0), InstanceId("worker", 1)


def test_a_worker_lost_and_back_between_two_samples_still_shows_as_a_dip():
    coord = Coordinator(Ledger([ShardInfo("s", 1000)], 100, 1, 10), num_ps=0)
    for w in (W0, W1):
        coord.membership.launched(w, relaunch=False)
        coord.membership.registered(w)
    assert coord.sample(0.0)["workers_alive"] == 1  # the fewest since the start: worker-1 came second
    assert coord.sample(0.0)["workers_alive"] == 2
    # Between samples: worker-0 is killed, relaunched and registered again (a forked relaunch: under a second).
    coord.membership.on_event(InstanceEvent(EventKind.LOST, W0, exit_code=-9, time=time.time()))
    coord.membership.launched(W0, relaunch=True)
    coord.membership.registered(W0)
    assert len(coord.membership.training()) == 2
    assert coord.sample(0.0)["workers_alive"] == 1  # the fewest since the previous sample
    assert coord.sample(0.0)["workers_alive"] == 2  # and back
