"""Gray failures on the local backend, in both strategies: a worker frozen with SIGSTOP keeps its lease and says
nothing, and the master must find it by its missing progress, declare it hung, requeue its lease from its watermark,
stop it and replace it. In the same job, nothing else may be declared hung: every worker's first step is long (its
first feed() sleeps, as a model that traces for long), the frozen worker's replacement's too, and one worker runs
ten times slower than the others (thirty in allreduce) but still reports: in ps it turns slow mid-epoch (a
straggler), and the idle workers take its work at the epochs' ends (master/gray/straggler.py): its lease ahead, or its
current lease's tail. In allreduce, where every step waits on it, it is slow from its start: the master finds it a
straggler by its own time per step, leaves it out of the ring and replaces it, and leaves out for good its
replacement, slow again (master/gray/ring_straggler.py); the job trains on without it. The frozen worker is resumed once
declared hung, before its kill (a zombie, as a pod in its grace period or a partitioned node back): fenced before
its lease was requeued, it is refused (its pushes by the PS shards, its calls by the master) and exits by itself. In
ps mode, later in the same job, the parameter server is frozen too: the master's probe finds it silent, declares it
hung, kills it and restores every shard from the last checkpoint, and the workers whose pushes waited on it wait for
the shards' new generation instead of crashing. Every record is still applied exactly once, by the tally model's
weights and the audit.

The bound is asserted as the master's decision (summary.json's events), never as a duration."""

from __future__ import annotations

import pytest

from tests.integration.harness import LEASES_OUTLAST_A_KILL, SMALL_LEASES, train
from tests.models.paced import paced_model
from tests.models.witness import TALLY_MODEL, assert_audit_exact, assert_chaos_fired, assert_each_record_applied_exactly

pytestmark = pytest.mark.slow

EPOCHS = 3
# allreduce: a ring of two fast members runs fifty tally steps a second. Enough steps, each long enough, that the
# job still trains when the straggler's replacement has started (its TensorFlow, its long first step: slower still
# when the machine is busy), joined the ring and shown its pace.
RING_EPOCHS = 12
PS_EPOCHS = 5  # the frozen worker's epoch, and room for the PS's freeze two epochs later
RING_STEP_S = 0.02
# Seconds; the first step below takes twice as long. Wide enough that a healthy worker of a suite that runs beside
# other jobs on two cores is never held that long between commits.
HANG_TIMEOUT = 6
FIRST_STEP_S = 12


@pytest.mark.parametrize("strategy", ["ps", "allreduce"])
def test_a_frozen_worker_is_declared_hung_and_replaced_and_nothing_else_is(tally_data, tmp_path, strategy):
    rows = tally_data["rows"]
    settings = {"global_batch": "fixed"} if strategy == "allreduce" else LEASES_OUTLAST_A_KILL  # the tally: lr 1
    # ps: the PS frozen later, mid-epoch too; a checkpoint every epoch's records, to go back to. Two epochs after
    # the worker's freeze: a freeze lands only on a worker with enough of its lease left, which may come an epoch
    # late, and the PS frozen in the same epoch would hold the frozen worker's clock until the job ends.
    frozen_ps = ["--chaos", f"stop:ps-0@{rows * 17 // 4}"] if strategy == "ps" else []
    if strategy == "ps":
        settings = settings | {"checkpoint_every": str(rows)}
    # ps: slowed once training is under way (through the gate its process looks for), to be a straggler.
    slow_at = rows // 2 if strategy == "ps" else 0
    # allreduce: the ring's tally steps take milliseconds; 30 times slower costs each step far more than the least a
    # straggler must cost (master/gray/ring_straggler.py), which a healthy member's noise on a loaded machine reaches.
    times = 10 if strategy == "ps" else 30
    epochs = PS_EPOCHS if strategy == "ps" else RING_EPOCHS
    out = tmp_path / "out"
    proc, summary = train(
        tally_data,
        out,
        "--chaos",
        f"slow:worker-0@{slow_at}:x{times}",
        "--chaos",
        # Mid-epoch, far from an epoch's evaluation; resumed once declared hung, before its kill: a zombie.
        f"stop:worker-1@{rows * 3 // 2}:resume",
        *frozen_ps,
        # Every first step is long (a model that traces for long), the frozen worker's replacement's too.
        model=paced_model(TALLY_MODEL, tmp_path, 0.0 if strategy == "ps" else RING_STEP_S, FIRST_STEP_S),
        strategy=strategy,
        epochs=epochs,
        max_workers=3,
        hang_timeout=HANG_TIMEOUT,
        **(SMALL_LEASES | settings),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = summary["events"]
    hung = [e for e in events if e["kind"] == "hung"]
    # Said first when the stop never fired: who, if anyone, was declared hung instead (a job below full strength
    # fires no named stop).
    assert ("stop", "worker-1") in [(f["action"], f["instance"]) for f in summary["chaos"]["fired"]], hung
    fired = assert_chaos_fired(summary, 3 if frozen_ps else 2)
    frozen = [("stop", "ps-0")] if frozen_ps else []
    assert [(f["action"], f["instance"]) for f in fired] == [("slow", "worker-0"), ("stop", "worker-1"), *frozen]
    log = (out / "logs" / "worker-0.1.log").read_text()
    assert f"chaos: worker-0 runs {times} times slower{' from now' if slow_at else ''}" in log  # it was slowed
    assert fired[0]["at_records"] >= slow_at
    if strategy == "ps":
        # Its work went to idle workers. Each hand-over is a decision on measured paces: on two cores shared with
        # other tests a healthy worker measured 4x slower than an idle one may hand over its tail too, at no cost.
        stragglers = [e for e in events if e["kind"] == "straggler"]
        assert "worker-0" in {e["instance"] for e in stragglers}, stragglers
        assert all(e["holder_records_per_s"] * 4 <= e["idle_records_per_s"] for e in stragglers), stragglers
        assert all("re-leased to worker-" in e["detail"] and e["records"] > 0 for e in stragglers), stragglers
        assert "is a straggler:" in proc.stderr
    else:
        # Every step waits on it: left out of the ring and replaced; its replacement, slowed again (`slow:` applies
        # to every launch), left out for good and not relaunched. By its own pace against the others', never theirs.
        stragglers = [e for e in events if e["kind"] == "straggler"]
        assert [(e["instance"], e["action"]) for e in stragglers] == [
            ("worker-0", "left out of the ring, replaced"),
            ("worker-0", "left out of the ring for good"),
        ], stragglers
        assert all(e["ratio"] >= 4 and e["step_s"] > e["others_step_s"] for e in stragglers), stragglers
        assert "worker-0 is a straggler: " in proc.stderr and "worker-0 is not relaunched: left out" in proc.stderr
        assert f"chaos: worker-0 runs {times} times slower" in (out / "logs" / "worker-0.2.log").read_text()
        assert not (out / "logs" / "worker-0.3.log").exists()
        lost = [e["detail"] for e in events if e["kind"] == "lost" and e["instance"] == "worker-0"]
        assert len(lost) == 2 and all(d.startswith("left out as a straggler, then") for d in lost), lost
    # Only the frozen ones: not the slowed worker, not one in its long first step, not its replacement in its own,
    # not the workers whose pushes waited on the frozen PS.
    expected = [("worker-1", HANG_TIMEOUT)] + ([("ps-0", HANG_TIMEOUT)] if frozen_ps else [])
    assert [(e["instance"], e["bound_s"]) for e in hung] == expected, hung
    assert hung[0]["idle_s"] >= HANG_TIMEOUT and "declared hung" in hung[0]["detail"]
    after = [e for e in events if e["t"] >= hung[0]["t"] and e["instance"] == "worker-1"]
    # Fenced before its lease was requeued, then resumed: refused, it ended by itself (EXIT_FENCED), not killed.
    assert [f["instance"] for f in summary["chaos"]["resumed"]] == ["worker-1"], summary["chaos"]
    fenced = [e for e in events if e["kind"] == "fenced" and e["instance"] == "worker-1"]
    assert fenced and fenced[0]["launch"] == 1 and "declared hung" in fenced[0]["detail"], fenced
    # Fenced before the hang requeued its lease (declare_hung records `hung`, then the requeue): the timeline's order,
    # not its clock. (An earlier requeue of worker-1 is possible in allreduce: a peer that could not reach it while
    # the ring re-formed around the straggler had it leave the ring, its launch still live and rejoining.)
    assert events.index(fenced[0]) < events.index(hung[0]), events
    zombie_log = (out / "logs" / "worker-1.1.log").read_text()
    assert "fenced: worker-1 launch 1" in zombie_log, zombie_log[-3000:]
    assert any(e["kind"] == "lost" and e["detail"] == "declared hung, then exit code 4" for e in after), after
    # The zombie's work was refused where it went first, which is where it was frozen: mid-step, its next push (ps:
    # by the PS shard, on its own count); between steps, its next call to the master (allreduce: its step report,
    # after its ring is gone). Whoever refused it, the other side agrees. (The shard's refusal alone, every time:
    # tests/unit/ps/test_server.py; on the real control plane, where the pod freezes mid-step: tests/kubernetes.)
    # The first launch's log: in ps the shard is frozen later and relaunched, with a count of its own.
    ps_log = (out / "logs" / "ps-0.1.log").read_text() if strategy == "ps" else ""
    refused_pushes = ps_log.count("refused a push of worker-1 launch 1")
    refused_calls = summary["fencing"]["fenced"]["worker-1"]["refused"]
    by_shard = "refuses its pushes" in zombie_log
    assert refused_pushes >= by_shard and refused_calls >= (not by_shard), (summary["fencing"], ps_log[-2000:])
    if refused_calls:
        assert any(e["kind"] == "fence_refused" for e in after), after
    assert any(e["kind"] == "decision" and e["detail"].startswith("relaunch:") for e in after), after
    # Its replacement started (it may find the job done before it registers: the others trained the rest).
    assert any(e["kind"] == "running" for e in after), after
    if strategy == "ps":  # its lease's remainder went back to the queue (allreduce: when it held one)
        assert any(e["kind"] == "requeued" for e in after), after
    assert "worker-1: no progress for" in proc.stderr and "declared hung" in proc.stderr
    # No worker whose push waited on the frozen PS crashed: the only decisions are worker-1's and the PS's (and in
    # allreduce the straggler's).
    decided = [(e["instance"], e["detail"].split(":")[0]) for e in events if e["kind"] == "decision"]
    if strategy == "ps":
        assert summary["workers"]["lost"] == 1 and summary["workers"]["relaunched"] == 1, summary["workers"]
        assert decided == [("worker-1", "relaunch")] + ([("ps-0", "restore")] if frozen_ps else []), decided
    else:
        assert summary["workers"]["lost"] == 3 and summary["workers"]["relaunched"] == 2, summary["workers"]
        assert [d for d in decided if d[0] == "worker-1"] == [("worker-1", "relaunch")], decided
        assert [d for d in decided if d[0] == "worker-0"] == [("worker-0", "relaunch"), ("worker-0", "retire")], decided
        assert len(decided) == 3, decided
    if frozen_ps:
        ps_hung = hung[1]
        assert ps_hung["idle_s"] >= HANG_TIMEOUT and "no answer for" in ps_hung["detail"], ps_hung
        after_ps = [e for e in events if e["t"] >= ps_hung["t"] and e["instance"] == "ps-0"]
        assert any(e["kind"] == "lost" and "declared hung" in e["detail"] for e in after_ps), after_ps
        assert "ps-0: no answer for" in proc.stderr, proc.stderr[-3000:]
    assert_each_record_applied_exactly(out, tally_data, epochs)
    assert_audit_exact(summary, strategy)
