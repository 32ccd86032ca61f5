"""Membership's count of the workers training, kept as states change (no listing of members at each)."""

from __future__ import annotations

import collections
import time

from elastic_step.backends.api import EventKind, InstanceEvent, InstanceId
from elastic_step.master.leases.membership import Membership


def test_the_training_count_follows_registrations_losses_and_relaunches():
    m = Membership()
    w0, w1, ps = InstanceId("worker", 0), InstanceId("worker", 1), InstanceId("ps", 0)
    for inst in (w0, w1, ps):
        m.launched(inst, relaunch=False)
        m.registered(inst)
    assert m.training_count() == len(m.training()) == 2  # a PS is not a worker
    m.on_event(InstanceEvent(EventKind.LOST, w0))
    assert m.training_count() == len(m.training()) == 1
    m.launched(w0, relaunch=True)
    assert m.training_count() == 1  # relaunched: pending until it registers again
    m.registered(w0, "")
    m.declared_gone(w1, 0.0)
    assert m.training_count() == len(m.training()) == 1
    assert m.max_alive == 2 and m.alive_samples[-1][1] == 1


def test_workers_by_state_follow_every_change_without_listing_them():
    m = Membership()
    w0, w1, ps = InstanceId("worker", 0), InstanceId("worker", 1), InstanceId("ps", 0)
    for inst in (w0, w1, ps):
        m.launched(inst, relaunch=False)
    m.on_event(InstanceEvent(EventKind.WAITING, w1, detail="Kueue has not admitted it", time=time.time()))
    m.registered(w0)
    assert +m.worker_states() == {"registered": 1, "queued": 1}  # the PS is not a worker
    m.on_event(InstanceEvent(EventKind.RUNNING, w1, time=time.time()))
    m.on_event(InstanceEvent(EventKind.LOST, w0, detail="killed by SIGKILL", time=time.time()))
    m.launched(w0, relaunch=True)
    states = m.worker_states()
    assert +states == {"running": 1, "pending": 1}, states
    assert +states == collections.Counter(x.state for i, x in m.members.items() if i.role == "worker")
