"""Chaos schedules: seeded, on progress, over the roles asked for, and each signal once per job across
a master's restarts (the journal beside the checkpoints)."""

from __future__ import annotations

import json
import time

import pytest

from elastic_step.backends.api import InstanceId
from elastic_step.errors import ElasticStepError
from elastic_step.faults.chaos import MASTER, Chaos


def test_a_random_schedule_over_roles_is_seeded_and_workers_only_by_default():
    workers = Chaos(["random:6:seed=4"], 10_000, 2, num_ps=2)
    assert all(sig.target is None for sig in workers.pending)  # a worker holding a lease, when it fires
    assert [s.at for s in Chaos(["random:6:seed=4:roles=worker"], 10_000, 2, num_ps=2).pending] == [
        s.at for s in workers.pending
    ]
    mixed = Chaos(["random:40:seed=4:roles=worker,ps,master"], 10_000, 2, num_ps=2)
    targets = {str(s.target) for s in mixed.pending}
    assert {"None", MASTER} <= targets and targets & {"ps-0", "ps-1"}
    again = Chaos(["random:40:seed=4:roles=worker,ps,master"], 10_000, 2, num_ps=2)
    assert [(s.action, s.at, str(s.target)) for s in again.pending] == [
        (s.action, s.at, str(s.target)) for s in mixed.pending
    ]
    assert [s.at for s in mixed.pending] == sorted(s.at for s in mixed.pending)


@pytest.mark.parametrize(
    "spec, says",
    [
        ("random:3:roles=worker,db", "Bad --chaos spec"),
        ("random:3:roles=ps", "targets parameter servers, and this job has none"),
    ],
)
def test_bad_roles_are_clear_errors(spec, says):
    with pytest.raises(ElasticStepError, match=says):
        Chaos([spec], 10_000, 2, num_ps=0)


@pytest.fixture
def job(tmp_path):
    """A real coordinator (worker-0 registered and holding a lease) and a real local backend running
    ps-0 and worker-0 as processes."""
    from elastic_step.backends.api import InstanceSpec
    from elastic_step.backends.local import LocalBackend
    from elastic_step.master.coordinator import Coordinator
    from elastic_step.master.ledger import Ledger, ShardInfo

    coord = Coordinator(Ledger([ShardInfo("s", 1000)], 100, 1, 10), num_ps=1)
    backend = LocalBackend(tmp_path / "logs")
    for inst in (InstanceId("ps", 0), InstanceId("worker", 0)):
        backend.start(InstanceSpec(inst, ["sleep", "600"]))
        coord.register(inst, "")
    coord.ledger.lease("worker-0", 0.0)
    yield coord, backend
    backend.close()


def test_a_resumed_master_skips_what_its_predecessor_fired(tmp_path, job):
    coord, backend = job
    journal = str(tmp_path / "chaos.json")
    specs = ["kill:ps-0@10", "kill:worker-0@20"]
    first = Chaos(specs, 1000, 1, num_ps=1)
    first.resume(journal, "job-1")
    first.tick(15, backend, coord)
    assert [f["instance"] for f in json.loads(open(journal).read())["fired"]] == ["ps-0"]
    # The master dies; its retry (same specs) resumes below the first signal's threshold, with ps-0
    # back (a new process).
    from elastic_step.backends.api import InstanceSpec

    deadline = time.monotonic() + 30
    while backend.pid(InstanceId("ps", 0)) is not None:  # the kill reaped
        assert time.monotonic() < deadline, "ps-0 was never killed"
        time.sleep(0.02)
    backend.start(InstanceSpec(InstanceId("ps", 0), ["sleep", "600"]))
    second = Chaos(specs, 1000, 1, num_ps=1)
    second.resume(journal, "job-1")
    second.tick(12, backend, coord)
    assert second.pending[0].target == InstanceId("worker", 0)  # ps-0 is not killed twice
    second.tick(25, backend, coord)
    assert not second.pending and InstanceId("ps", 0) in backend.alive()
    other = Chaos(specs, 1000, 1, num_ps=1)
    other.resume(journal, "job-2")  # another job's journal is not its own
    assert len(other.pending) == 2
    respecified = Chaos(["kill:ps-0@10"], 1000, 1, num_ps=1)
    respecified.resume(journal, "job-1")  # nor is one of other specs
    assert len(respecified.pending) == 1
    fired = second.summary()["fired"]
    assert [(f["instance"], f.get("by_previous_master", False)) for f in fired] == [("ps-0", True), ("worker-0", False)]


def test_a_job_given_no_specs_takes_elastic_step_chaos_s(monkeypatch):
    from elastic_step.faults import api, chaos

    monkeypatch.setenv(chaos.ENV, "kill:worker-0@10,term:ps-0@20")
    assert chaos.specs(()) == ("kill:worker-0@10", "term:ps-0@20")  # a pipeline's step, disturbed from outside
    assert chaos.specs(["kill:worker-1@5"]) == ("kill:worker-1@5",)
    monkeypatch.delenv(chaos.ENV)
    assert chaos.for_job((), 1000, 2, num_ps=1) is api.NO_FAULTS and api.NO_FAULTS.summary() is None
