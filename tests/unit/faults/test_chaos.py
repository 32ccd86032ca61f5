"""Chaos schedules: seeded, on progress, over the roles asked for, and each signal once per job across
a master's restarts (the journal beside the checkpoints)."""

from __future__ import annotations

import json
import os
import time

import pytest

from elastic_step.backends.api import Backend, InstanceId
from elastic_step.backends.local import LocalBackend
from elastic_step.errors import ConfigError, ElasticStepError
from elastic_step.faults import chaos as chaos_module
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


def test_a_seed_draws_the_schedule_it_always_drew_unless_actions_are_asked_for():
    # The schedules these seeds drew before `stop` existed: tests and benchmarks rely on them.
    mixed = Chaos(["random:6:seed=4:roles=worker,ps,master"], 10_000, 2, 2).pending
    assert [(s.action, s.at, str(s.target)) for s in mixed] == [
        ("term", 965, "ps-0"),
        ("kill", 1090, "master"),
        ("term", 1421, "master"),
        ("kill", 4289, "master"),
        ("term", 4453, "ps-1"),
        ("kill", 4970, "ps-0"),
    ]
    assert [(s.action, s.at, s.rank) for s in Chaos(["random:4:seed=7"], 10_000, 3, 1).pending] == [
        ("kill", 1409, [1, 2, 0]),
        ("kill", 1487, [2, 1, 0]),
        ("term", 2472, [1, 0, 2]),
        ("kill", 5992, [2, 0, 1]),
    ]
    drawn = Chaos(["random:30:seed=7:actions=kill,term,stop"], 10_000, 3, 1).pending
    assert {s.action for s in drawn} == {"kill", "term", "stop"} and all(s.target is None for s in drawn)
    assert {s.action for s in Chaos(["random:10:seed=7:actions=stop"], 10_000, 3, 1).pending} == {"stop"}
    frozen = Chaos(["random:10:seed=7:actions=stop:roles=worker,ps"], 10_000, 3, 2).pending
    assert {s.action for s in frozen} == {"stop"} and {s.target.role for s in frozen if s.target} == {"ps"}


def test_stop_and_slow_are_scheduled_and_a_slowed_worker_learns_its_factor_at_every_launch():
    chaos = Chaos(["stop:worker-1@400", "slow:worker-0@0:x10"], 10_000, 2, num_ps=1)
    assert chaos.schedule == [
        {"action": "slow", "at_records": 0, "instance": "worker-0", "factor": 10.0},
        {"action": "stop", "at_records": 400, "instance": "worker-1"},
    ]
    assert chaos.instance_env(InstanceId("worker", 0)) == {"ELASTIC_STEP_SLOW": "10"}
    assert chaos.instance_env(InstanceId("worker", 1)) == {}
    chaos.pending.clear()  # all fired (a retried master's view): the worker is still launched slow
    assert chaos.instance_env(InstanceId("worker", 0)) == {"ELASTIC_STEP_SLOW": "10"}
    # A job's master says how long its shortest hang bound is: a slowed step never pauses a quarter of it (an
    # allreduce run commits two steps or more).
    bounded = Chaos(["slow:worker-0@0:x10"], 10_000, 2, num_ps=1, hang_bound_s=6)
    env = bounded.instance_env(InstanceId("worker", 0))
    assert env == {"ELASTIC_STEP_SLOW": "10", "ELASTIC_STEP_SLOW_MAX_S": "1.5"}


@pytest.mark.parametrize(
    "spec, says",
    [
        ("random:3:roles=worker,db", "Bad --chaos spec"),
        ("random:3:roles=ps", "targets parameter servers, and this job has none"),
        ("random:3:actions=kill,boom", "Bad --chaos spec"),
        ("random:3:actions=stop:roles=worker,master", "not the master"),
        ("stop:master@10", "not the master"),
        ("slow:worker-1@-5:x10", "Bad --chaos spec"),
        ("slow:worker-1@0:x1", "Bad --chaos spec"),
        ("slow:ps-0@0:x4", "Bad --chaos spec"),
        ("slow:worker-1@0", "Bad --chaos spec"),
        ("stop:worker-1@10:later", "Bad --chaos spec"),
        ("kill:worker-1@10:resume", "Bad --chaos spec"),
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
    from elastic_step.master.leases.coordinator import Coordinator
    from elastic_step.master.leases.ledger import Ledger, ShardInfo

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
    second.tick(25, backend, coord)  # no commit of worker-0's seen since: its last report may be on its way
    assert second.pending
    _commit_once(coord)
    second.tick(25, backend, coord)  # right after a commit, most of the lease to go
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
    from elastic_step import fault_hooks
    from elastic_step.faults import chaos

    monkeypatch.setenv(chaos.ENV, "kill:worker-0@10,term:ps-0@20")
    assert chaos.specs(()) == ("kill:worker-0@10", "term:ps-0@20")  # a pipeline's step, disturbed from outside
    assert chaos.specs(["kill:worker-1@5"]) == ("kill:worker-1@5",)
    monkeypatch.delenv(chaos.ENV)
    assert chaos.for_job((), 1000, 2, num_ps=1) is fault_hooks.NO_FAULTS and fault_hooks.NO_FAULTS.summary() is None


def test_stop_freezes_its_target_and_slow_fires_once_its_worker_trains(job):
    coord, backend = job
    chaos = Chaos(["slow:worker-0@0:x4", "stop:worker-0@10", "stop:ps-0@20"], 1000, 1, num_ps=1)
    chaos.tick(0, backend, coord)
    assert [(f["action"], f["instance"]) for f in chaos.fired] == [("slow", "worker-0")]
    chaos.tick(15, backend, coord)  # not before the worker's first commit: a start-up hang is another bound's
    assert len(chaos.fired) == 1
    _commit_once(coord)
    chaos.tick(15, backend, coord)
    chaos.tick(25, backend, coord)
    assert [(f["action"], f["instance"]) for f in chaos.fired][1:] == [("stop", "worker-0"), ("stop", "ps-0")]
    for inst in (InstanceId("worker", 0), InstanceId("ps", 0)):
        pid = backend.pid(inst)
        deadline = time.monotonic() + 30
        while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":  # stopped
            assert time.monotonic() < deadline, f"{inst} was never frozen"
            time.sleep(0.02)
    assert [e["kind"] for e in coord.timeline.events if e["instance"] == "worker-0"][-2:] == ["chaos", "chaos"]


def test_a_signal_to_a_worker_lands_right_after_a_commit_with_minibatches_of_its_lease_to_go(job):
    """Else the reports on their way could end the lease, and a kill would leave nothing to requeue (a run of
    allreduce steps is reported at once)."""
    coord, backend = job
    chaos = Chaos(["kill:worker-0@10"], 1000, 1, num_ps=1)
    lease = coord.ledger.leases["worker-0"]
    worker = InstanceId("worker", 0)
    chaos.tick(15, backend, coord)
    chaos.tick(15, backend, coord)
    assert chaos.pending  # no commit since the last tick: its last report may be on its way
    for step in range(1, 8):  # 10-record minibatches: 30 records, 3 minibatches, to go
        assert coord.report_progress(worker, lease.task.task_id, lease.start + 10 * step, 0.0, False)
    chaos.tick(15, backend, coord)
    assert chaos.pending  # right after a commit, but too little to go
    fresh = Chaos(["kill:worker-0@10"], 1000, 1, num_ps=1)
    fresh.tick(15, backend, coord)
    coord.ledger.leases.pop("worker-0")  # the lease ends; at the next tick, a new one was just granted
    coord.ledger.lease("worker-0", 0.0)
    fresh.tick(15, backend, coord)
    assert [f["instance"] for f in fresh.fired] == ["worker-0"]


def test_a_preemption_waits_for_its_own_worker_alone_and_not_for_full_strength(job):
    """preempt: (bench/churn.py's trace) lands on its worker once it trains, while the job is short of workers, and
    one whose worker is down (worker-1 here: never started) holds back no other worker's."""
    coord, backend = job
    with pytest.raises(ElasticStepError, match="Bad --chaos spec 'preempt:ps-0@10'"):
        Chaos(["preempt:ps-0@10"], 1000, 2, num_ps=1)
    chaos = Chaos(["preempt:worker-1@10", "preempt:worker-0@12", "kill:worker-0@14"], 1000, 2, num_ps=1)
    assert chaos.schedule[0] == {"action": "kill", "at_records": 10, "instance": "worker-1", "preempt": True}
    chaos.tick(15, backend, coord)
    coord.ledger.leases.pop("worker-0")  # a lease just granted, before the launch's first commit: not yet
    coord.ledger.lease("worker-0", 0.0)
    chaos.tick(15, backend, coord)
    assert chaos.fired == []
    _commit_once(coord)
    chaos.tick(15, backend, coord)
    assert [(f["instance"], f["at_records"]) for f in chaos.fired] == [("worker-0", 15)]
    assert [(str(sig.target), sig.preempt) for sig in chaos.pending] == [("worker-1", True), ("worker-0", False)]
    deadline = time.monotonic() + 30
    while backend.alive() and InstanceId("worker", 0) in backend.alive():
        assert time.monotonic() < deadline, "worker-0 was never killed"
        time.sleep(0.02)


def _commit_once(coord) -> None:
    """worker-0 reports its lease's first minibatch: its first commit of the launch."""
    lease = coord.ledger.leases["worker-0"]
    assert coord.report_progress(InstanceId("worker", 0), lease.task.task_id, lease.start + 10, 0.0, False)


def _state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def test_a_zombie_is_resumed_once_declared_hung_and_its_kill_deferred(job):
    coord, backend = job
    with pytest.raises(ElasticStepError, match="resume makes a zombie of a worker only; use stop:ps-0@10"):
        Chaos(["stop:ps-0@10:resume"], 1000, 1, num_ps=1)
    chaos = Chaos(["stop:worker-0@10:resume"], 1000, 1, num_ps=1)
    zombie = {"action": "stop", "at_records": 10, "instance": "worker-0", "resume": "once declared hung"}
    assert chaos.schedule == [zombie]
    worker = InstanceId("worker", 0)
    assert chaos.kill_deferred(worker, backend) == 0.0  # not frozen yet: nothing to resume
    chaos.tick(15, backend, coord)  # the watermark its commit moves
    _commit_once(coord)
    chaos.tick(15, backend, coord)
    pid = backend.pid(worker)
    deadline = time.monotonic() + 30
    while _state(pid) != "T":
        assert time.monotonic() < deadline, "worker-0 was never frozen"
        time.sleep(0.02)
    assert chaos.kill_deferred(InstanceId("worker", 1), backend) == 0.0  # another worker is killed at once
    assert chaos.kill_deferred(worker, backend) == chaos_module.ZOMBIE_KILL_AFTER_S
    while _state(pid) == "T":
        assert time.monotonic() < deadline, "worker-0 was never resumed"
        time.sleep(0.02)
    assert chaos.kill_deferred(worker, backend) == 0.0  # once: its successor is killed at once when hung
    assert chaos.summary()["resumed"] == [{"action": "resume", "instance": "worker-0"}]


def test_a_freeze_waits_while_a_frozen_worker_is_not_yet_declared_hung(job):
    """A PS frozen beside a frozen worker would hold the worker's hang clock: the worker would never be declared
    hung. So the PS's freeze waits for the zombie's resume; the witness is each process's state in /proc."""
    coord, backend = job
    chaos = Chaos(["stop:worker-0@10:resume", "stop:ps-0@20"], 1000, 1, num_ps=1)
    chaos.tick(15, backend, coord)
    _commit_once(coord)
    chaos.tick(15, backend, coord)
    chaos.tick(25, backend, coord)
    assert [f["instance"] for f in chaos.fired] == ["worker-0"]
    worker, ps = InstanceId("worker", 0), InstanceId("ps", 0)
    assert _state(backend.pid(ps)) != "T"
    chaos.kill_deferred(worker, backend)  # declared hung: resumed
    chaos.tick(25, backend, coord)
    assert [f["instance"] for f in chaos.fired] == ["worker-0", "ps-0"]
    deadline = time.monotonic() + 30
    while _state(backend.pid(ps)) != "T":
        assert time.monotonic() < deadline, "ps-0 was never frozen"
        time.sleep(0.02)


def test_a_slowed_worker_sleeps_its_factor_less_one_times_each_step_but_its_first(monkeypatch):
    from elastic_step import fault_hooks
    from elastic_step.faults import process

    slept = []
    monkeypatch.setattr(process.time, "sleep", slept.append)
    monkeypatch.setenv(process.SLOW_ENV, "10")
    process.install_worker_faults("worker-1")
    try:
        for seconds in (4.0, 0.02, 0.03):  # the first step traces: no pace to slow
            fault_hooks.STEP_DONE(seconds)
        # A step far longer than the ones before (a retrace, a read on a busy machine) is slowed as twice their
        # median, not by its own time: 9 x 1.5 s would leave the worker silent for longer than a hang's bound.
        for seconds in (0.02, 0.02, 1.5):
            fault_hooks.STEP_DONE(seconds)
    finally:
        fault_hooks.STEP_DONE.install(None)
    assert slept == pytest.approx([0.18, 0.27, 0.18, 0.18, 0.36])


def test_a_slowed_worker_on_a_loaded_machine_never_pauses_for_longer_than_its_cap(monkeypatch):
    """Steps of a second on a busy machine, slowed ten times, would leave it silent past a 6 s hang bound: a slow
    worker that still reports is capped at what the master gave it (half its bound)."""
    from elastic_step import fault_hooks
    from elastic_step.faults import process

    slept = []
    monkeypatch.setattr(process.time, "sleep", slept.append)
    monkeypatch.setenv(process.SLOW_ENV, "10")
    monkeypatch.setenv(process.SLOW_MAX_ENV, "3")
    process.install_worker_faults("worker-0")
    try:
        for seconds in (4.0, 0.1, 0.8, 1.0):
            fault_hooks.STEP_DONE(seconds)
    finally:
        fault_hooks.STEP_DONE.install(None)
    assert slept == pytest.approx([0.9, 3.0, 3.0])


def test_a_stop_is_refused_at_the_jobs_start_by_a_backend_that_cannot_freeze():
    class Remote(Backend):  # the Kubernetes backend's case: it deletes pods, it cannot reach into their processes
        name = "remote"
        start = stop = kill = alive = master_address = None

    Chaos(["kill:worker-0@10"], 1000, 2).check_backend(Remote())  # nothing to freeze
    for spec in ("stop:worker-1@10", "random:3:seed=1:actions=stop"):
        with pytest.raises(ConfigError, match="the remote backend cannot freeze an instance: .* Use --backend local"):
            Chaos([spec], 1000, 2).check_backend(Remote())
    with pytest.raises(ConfigError, match="cannot freeze"):
        Remote().freeze(InstanceId("worker", 1))
    assert LocalBackend.can_freeze


def test_a_worker_slowed_later_is_slowed_once_its_gate_opens_and_later_launches_of_it_start_slow(job, monkeypatch):
    from elastic_step import fault_hooks
    from elastic_step.faults import process

    coord, backend = job
    chaos = Chaos(["slow:worker-0@10:x4"], 1000, 1, num_ps=1)
    assert chaos.schedule == [{"action": "slow", "at_records": 10, "instance": "worker-0", "factor": 4.0}]
    factor, gate = chaos.instance_env(InstanceId("worker", 0))[process.SLOW_ENV].split("@")
    assert factor == "4" and not os.path.exists(gate)
    slept = []
    monkeypatch.setattr(process.time, "sleep", slept.append)
    monkeypatch.setenv(process.SLOW_ENV, f"{factor}@{gate}")
    process.install_worker_faults("worker-0")
    try:
        fault_hooks.STEP_DONE(4.0)  # its first step
        fault_hooks.STEP_DONE(0.02)
        chaos.tick(5, backend, coord)
        assert not chaos.fired and not os.path.exists(gate)
        fault_hooks.STEP_DONE(0.02)
        chaos.tick(15, backend, coord)
        assert [(f["action"], f["at_records"]) for f in chaos.fired] == [("slow", 15)] and os.path.exists(gate)
        fault_hooks.STEP_DONE(0.02)
    finally:
        fault_hooks.STEP_DONE.install(None)
    assert slept == pytest.approx([0.06])
    assert chaos.instance_env(InstanceId("worker", 0)) == {process.SLOW_ENV: "4"}  # fired: a relaunch starts slow
    assert "slow x4 at 15 records" in [e["detail"] for e in coord.timeline.events if e["kind"] == "chaos"]
    chaos.close()  # the job's end: the gate's folder goes
    assert not os.path.exists(os.path.dirname(gate))
    with pytest.raises(ElasticStepError, match="one slow: spec per worker"):
        Chaos(["slow:worker-1@0:x2", "slow:worker-1@40:x3"], 10_000, 2, num_ps=1)
