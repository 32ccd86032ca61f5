"""The allreduce rendezvous: versions, admission at a commit, abort on loss, commit only when all ready,
and the ledger commit of a step being atomic (through the Coordinator)."""

from __future__ import annotations

import threading

from elastic_step.backends.api import EventKind, InstanceEvent, InstanceId
from elastic_step.master.leases.coordinator import Coordinator
from elastic_step.master.leases.ledger import Ledger, ShardInfo
from elastic_step.master.leases.rendezvous import ABORT, COMMIT, WAIT, Ready, Rendezvous


def ready(task=-1, wm=0, records=0, checksum=7):
    return Ready(task, wm, records, 0.0, checksum)


def started(n=2, min_workers=2):
    r = Rendezvous(min_workers=min_workers, max_workers=3)
    for i in range(n):
        r.join(f"worker-{i}", f"a{i}")
    return r


def test_training_starts_at_min_workers_in_registration_order():
    r = Rendezvous(min_workers=2, max_workers=3)
    r.join("worker-1", "a1")
    assert r.version == 0 and r.membership("worker-1").state == "waiting"
    r.join("worker-0", "a0")
    assert r.version == 1
    v = r.membership("worker-0")
    assert v.state == "member" and v.members == [("worker-1", "a1"), ("worker-0", "a0")] and v.rank == 1
    assert v.base_step == 0


def test_commit_only_when_every_member_is_ready_and_idempotent():
    r = started()
    assert r.step_ready("worker-0", 1, 1, ready())[0] == WAIT
    assert r.committed_step == 0
    assert r.step_ready("worker-1", 1, 1, ready())[0] == COMMIT
    assert r.committed_step == 1 and r.steps_committed == 1
    # The first member asks again (its long-poll timed out): COMMIT, not a second commit.
    assert r.step_ready("worker-0", 1, 1, ready())[0] == COMMIT
    assert r.steps_committed == 1
    # A run of steps 2-4 commits at once, as 3 steps.
    assert r.step_ready("worker-0", 1, 4, ready())[0] == WAIT
    assert r.step_ready("worker-1", 1, 4, ready())[0] == COMMIT
    assert r.committed_step == 4 and r.steps_committed == 4 and r.runs_committed == 2
    # A step already behind the commits, and not one of them, is refused.
    assert r.step_ready("worker-0", 1, 3, ready())[0] == ABORT


def test_members_that_end_a_run_at_different_steps_start_a_new_version():
    """They decide where a run ends from the same allreduced flag: steps that differ are a fault, and no member
    may commit the other's run."""
    r = started()
    assert r.step_ready("worker-0", 1, 2, ready())[0] == WAIT
    assert r.step_ready("worker-1", 1, 3, ready())[0] == ABORT
    assert r.version == 2 and r.committed_step == 0
    assert r.step_ready("worker-0", 1, 2, ready())[0] == ABORT


def test_long_poll_wakes_up_on_commit():
    r = started()
    out = {}
    t = threading.Thread(target=lambda: out.update(k=r.step_ready("worker-0", 1, 1, ready(), wait_s=5)[0]))
    t.start()
    r.step_ready("worker-1", 1, 1, ready())
    t.join(2)
    assert out["k"] == COMMIT


def test_newcomer_pending_until_the_next_commit():
    r = started()
    r.join("worker-2", "a2")
    assert r.version == 1 and r.membership("worker-2").state == "pending"
    r.step_ready("worker-0", 1, 1, ready())
    kind, view = r.step_ready("worker-1", 1, 1, ready())
    assert kind == COMMIT
    assert view.version == 2 and [n for n, _ in view.members] == ["worker-0", "worker-1", "worker-2"]
    assert view.base_step == 1
    v2 = r.membership("worker-2")
    assert v2.state == "member" and v2.rank == 2 and v2.base_step == 1
    # The commit of step 1 happened in version 1: a late re-ask with version 1 still gets COMMIT.
    assert r.step_ready("worker-0", 1, 1, ready())[0] == COMMIT
    for w in ("worker-0", "worker-1"):
        assert r.step_ready(w, 2, 2, ready())[0] == WAIT
    assert r.step_ready("worker-2", 2, 2, ready())[0] == COMMIT
    assert len(r.join_to_first_commit_s) == 1


def test_loss_bumps_the_version_and_aborts_the_step():
    r = started(3, min_workers=3)
    assert r.step_ready("worker-0", 1, 1, ready())[0] == WAIT
    out = {}
    t = threading.Thread(target=lambda: out.update(k=r.step_ready("worker-1", 1, 1, ready(), wait_s=5)))
    t.start()
    r.lost("worker-2", "killed")
    t.join(2)
    kind, view = out["k"]
    assert kind == ABORT and view.version == 2 and [n for n, _ in view.members] == ["worker-0", "worker-1"]
    assert r.aborted_steps == 1 and r.committed_step == 0
    # Retry of the same step in the new version commits with the survivors only.
    assert r.step_ready("worker-0", 2, 1, ready())[0] == WAIT
    assert r.step_ready("worker-1", 2, 1, ready())[0] == COMMIT
    assert len(r.loss_to_next_commit_s) == 1
    # The lost member is evicted: its late reports abort.
    assert r.membership("worker-2").state == "evicted"
    assert r.step_ready("worker-2", 1, 1, ready())[0] == ABORT


def test_a_member_being_killed_holds_the_run_it_reported_until_its_loss_aborts_it():
    # Its report was on its way when the signal went: the others' reports must not commit its run.
    r = started(3, min_workers=3)
    assert r.step_ready("worker-2", 1, 1, ready())[0] == WAIT
    r.leave("worker-2")
    assert r.step_ready("worker-0", 1, 1, ready())[0] == WAIT
    assert r.step_ready("worker-1", 1, 1, ready())[0] == WAIT  # every member ready: held
    assert r.committed_step == 0
    r.lost("worker-2", "killed by SIGKILL")
    assert r.step_ready("worker-0", 1, 1, ready())[0] == ABORT and r.committed_step == 0
    assert not r.leaving
    # The ring without it commits again.
    assert r.step_ready("worker-0", 2, 1, ready())[0] == WAIT
    assert r.step_ready("worker-1", 2, 1, ready())[0] == COMMIT


def test_leaving_names_members_only():
    r = started()
    assert not r.leave("worker-7")
    assert not r.leaving
    assert r.step_ready("worker-0", 1, 1, ready())[0] == WAIT
    assert r.step_ready("worker-1", 1, 1, ready())[0] == COMMIT


def test_a_member_leaves_only_while_its_condition_holds_under_the_commit_lock():
    # The chaos looks at the victim's lease without the lock; a run that committed before the kill ended it. So
    # leave() asks again under the lock runs commit under, and holds nothing when the lease moved meanwhile.
    r = started()
    asked = []

    def moved() -> bool:
        asked.append(r.cv._is_owned())  # under the lock
        return False

    assert not r.leave("worker-1", moved) and asked == [True]
    assert not r.leaving
    assert r.step_ready("worker-0", 1, 1, ready())[0] == WAIT
    assert r.step_ready("worker-1", 1, 1, ready())[0] == COMMIT
    assert r.leave("worker-1", lambda: True) and r.leaving == {"worker-1"}


def test_peer_failure_of_a_stale_version_is_ignored():
    r = started(3, min_workers=3)

    def peer_failed(reporter: str, version: int, peer: str, detail: str) -> bool:
        with r.cv:  # as the coordinator calls it, under its lock
            return r.peer_failed_locked(reporter, version, peer, detail)

    assert not peer_failed("worker-0", 0, "worker-1", "x")
    assert peer_failed("worker-0", 1, "worker-1", "UNAVAILABLE")
    assert r.version == 2
    assert not peer_failed("worker-2", 1, "worker-0", "late")


def test_checksum_mismatch_is_counted():
    r = started()
    r.step_ready("worker-0", 1, 1, ready(checksum=1))
    r.step_ready("worker-1", 1, 1, ready(checksum=2))
    assert r.checksum_mismatches == 1


def test_coordinator_commits_every_member_watermark_at_once_and_requeues_the_lost_remainder():
    ledger = Ledger([ShardInfo("s0", 64)], records_per_task=32, epochs=1, minibatch_size=8)
    coord = Coordinator(ledger, num_ps=0, min_workers=2, ring_max_workers=2)
    rdv = coord.rendezvous
    w0, w1 = InstanceId("worker", 0), InstanceId("worker", 1)
    coord.register(w0, "a0")
    coord.register(w1, "a1")
    l0, l1 = coord.get_task(w0), coord.get_task(w1)
    r0 = Ready(l0.task.task_id, l0.start + 8, 8, 1.0, 5)
    assert rdv.step_ready("worker-0", 1, 1, r0)[0] == WAIT
    assert ledger.records_committed_total() == 0  # nothing commits before everyone is ready
    rdv.step_ready("worker-1", 1, 1, Ready(l1.task.task_id, l1.start + 8, 8, 1.0, 5))
    assert ledger.records_committed_total() == 16
    # worker-1 dies in step 2: the step aborts, its remainder goes back to the queue at once.
    rdv.step_ready("worker-0", 1, 2, Ready(l0.task.task_id, l0.start + 16, 8, 1.0, 5))
    coord.on_instance_event(InstanceEvent(EventKind.LOST, w1, exit_code=-9, detail="killed by SIGKILL"))
    assert rdv.version == 2 and ledger.records_committed_total() == 16
    assert ledger.account.requeued == 24
    assert rdv.step_ready("worker-0", 2, 2, Ready(l0.task.task_id, l0.start + 16, 8, 1.0, 5))[0] == COMMIT
    assert ledger.records_committed_total() == 24


def one_member_that_committed(max_workers: int):
    """A coordinator whose rendezvous has worker-0 as its only member, with one task (16 records)
    committed: (coord, rendezvous, ledger)."""
    from elastic_step.master.leases.coordinator import Coordinator
    from elastic_step.master.leases.ledger import Ledger, ShardInfo

    ledger = Ledger([ShardInfo("s0", 64)], records_per_task=16, epochs=2, minibatch_size=16)
    coord = Coordinator(ledger, 0, min_workers=1, ring_max_workers=max_workers)
    rdv = coord.rendezvous
    with coord.lock:
        rdv.join_locked("worker-0", "a0")
        lease = ledger.lease("worker-0", 0.0)
        ledger.report("worker-0", lease.task.task_id, lease.task.end)
    assert ledger.records_committed_total() == 16
    return coord, rdv, ledger


def test_when_every_member_is_lost_the_newcomers_start_over_and_the_ledger_rewinds():
    coord, rdv, ledger = one_member_that_committed(max_workers=1)
    with coord.lock:
        rdv.remove_locked("worker-0", "killed")
        rdv.join_locked("worker-1", "a1")  # from its own initial weights: nothing it holds is trained
    assert ledger.records_committed_total() == 0 and ledger.trained_again == 16
    assert ledger.epoch == 0 and len(ledger.queue) == 4 and not ledger.leases
    assert any(e["kind"] == "rewound" for e in coord.timeline.events)


def test_when_the_last_member_is_lost_while_a_newcomer_waits_the_ledger_rewinds_too():
    coord, rdv, ledger = one_member_that_committed(max_workers=2)
    with coord.lock:
        rdv.join_locked("worker-1", "a1")  # pending: admitted at the next step commit
        rdv.remove_locked("worker-0", "killed")  # ...which never comes: it is admitted from its own weights
    assert rdv._names() == ["worker-1"]
    assert ledger.records_committed_total() == 0 and ledger.trained_again == 16


def test_while_commits_are_held_for_a_checkpoint_no_step_commits_then_the_waiting_one_does():
    r = started()
    r.hold_commits = True
    assert r.step_ready("worker-0", 1, 1, ready())[0] == WAIT
    assert r.step_ready("worker-1", 1, 1, ready())[0] == WAIT  # every member ready: still held
    assert r.committed_step == 0
    out = {}
    t = threading.Thread(target=lambda: out.update(k=r.step_ready("worker-0", 1, 1, ready(), wait_s=5)[0]))
    t.start()
    with r.cv:
        r.release_commits()
    t.join(2)
    assert out["k"] == COMMIT and r.committed_step == 1 and r.steps_committed == 1
    assert r.step_ready("worker-1", 1, 1, ready())[0] == COMMIT


def test_a_resumed_rendezvous_starts_at_the_checkpoints_step_whose_state_comes_from_the_master():
    r = Rendezvous(min_workers=2, max_workers=3)
    r.restore(40, checkpoint_id=3)
    r.join("worker-0", "a0")
    r.join("worker-1", "a1")
    v = r.membership("worker-1")
    assert (v.version, v.base_step, v.restore_checkpoint) == (1, 40, 3)
    assert r.step_ready("worker-0", 1, 1, ready())[0] == ABORT  # the steps go on from the checkpoint's
    r.step_ready("worker-0", 1, 41, ready())
    assert r.step_ready("worker-1", 1, 41, ready())[0] == COMMIT
    # Once a step committed, the members hold the state: a newcomer pulls it from rank 0.
    assert r.membership("worker-0").restore_checkpoint == 0
    r.join("worker-2", "a2")
    r.step_ready("worker-0", 1, 42, ready())
    assert r.step_ready("worker-1", 1, 42, ready())[0] == COMMIT  # worker-2 admitted at this commit
    v = r.membership("worker-2")
    assert (v.state, v.base_step, v.restore_checkpoint) == ("member", 42, 0)


def test_a_coordinator_checkpoint_hold_in_allreduce_holds_commits_not_leases():
    ledger = Ledger([ShardInfo("s0", 64)], 16, 1, minibatch_size=8)
    c = Coordinator(ledger, num_ps=0, min_workers=1, ring_max_workers=2)
    rdv = c.rendezvous
    c.register(InstanceId("worker", 0), "a0")
    c.begin_hold()
    assert c.hold_reached() and c.waiting_for_hold() == []
    assert c.get_task(InstanceId("worker", 0)) not in (None, "done")  # leases go on being handed out
    assert rdv.step_ready("worker-0", 1, 1, ready())[0] == WAIT
    c.end_hold()
    assert rdv.step_ready("worker-0", 1, 1, ready())[0] == COMMIT
