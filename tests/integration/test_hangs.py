"""Gray failures on the local backend, in both strategies: a worker frozen with SIGSTOP keeps its lease and says
nothing, and the master must find it by its missing progress, declare it hung, requeue its lease from its
watermark, stop it and replace it. In the same job, nothing else may be declared hung: every worker's first
step is long (its first feed() sleeps, as a model that traces for long), the frozen worker's replacement's too,
and one worker runs much slower than the others but still reports. In `ps` that worker turns slow mid-epoch (a
hundred times: a straggler), and the idle workers take its work at the epochs' ends (master/straggler.py): its
lease ahead, or its current lease's tail. Every record is still applied exactly once, by the tally model's weights
and the audit.

The bound is asserted as the master's decision (summary.json's events), never as a duration."""

from __future__ import annotations

import textwrap

import pytest

from tests.integration.harness import LEASES_OUTLAST_A_KILL, SMALL_LEASES, train
from tests.models.witness import TALLY_MODEL, assert_audit_exact, assert_chaos_fired, assert_each_record_applied_exactly

pytestmark = pytest.mark.slow

EPOCHS = 3
# Seconds; the first step below takes twice as long. Wide enough that a healthy worker of a suite that runs beside
# other jobs on two cores is never held that long between commits.
HANG_TIMEOUT = 6
FIRST_STEP_S = 12

# The tally model whose first feed() in a worker process sleeps (the master's own calls, for evaluation, do not).
SLOW_START = f"""
import time

from elastic_step.util.process import PARENT_ENV


def feed(batch):
    global _started
    if os.environ.get(PARENT_ENV) and not globals().get("_started"):
        _started = True
        time.sleep({FIRST_STEP_S})  # a first step that traces for long
    return tally_feed(batch)
"""


def slow_start_tally(tmp_path) -> str:
    path = tmp_path / "slow_start_tally.py"
    source = open(TALLY_MODEL).read().replace("def feed(", "def tally_feed(")
    path.write_text(source + textwrap.dedent(SLOW_START))
    return str(path)


@pytest.mark.parametrize("strategy", ["ps", "allreduce"])
def test_a_frozen_worker_is_declared_hung_and_replaced_and_nothing_else_is(tally_data, tmp_path, strategy):
    settings = {"global_batch": "fixed"} if strategy == "allreduce" else LEASES_OUTLAST_A_KILL  # the tally: lr 1
    # allreduce: every step waits for the slowest member, so ten times is enough (and a hundred would be long).
    # ps: slowed once training is under way, through the gate its process looks for.
    times, slow_at = (100, tally_data["rows"] // 2) if strategy == "ps" else (10, 0)
    out = tmp_path / "out"
    proc, summary = train(
        tally_data,
        out,
        "--chaos",
        f"slow:worker-0@{slow_at}:x{times}",
        "--chaos",
        f"stop:worker-1@{tally_data['rows'] * 3 // 2}",  # mid-epoch: far from an epoch's evaluation
        model=slow_start_tally(tmp_path),
        strategy=strategy,
        epochs=EPOCHS,
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
    fired = assert_chaos_fired(summary, 2)
    assert [(f["action"], f["instance"]) for f in fired] == [("slow", "worker-0"), ("stop", "worker-1")]
    log = (out / "logs" / "worker-0.1.log").read_text()
    assert f"chaos: worker-0 runs {times} times slower{' from now' if slow_at else ''}" in log  # it was slowed
    assert fired[0]["at_records"] >= slow_at
    if strategy == "ps":
        # Its work went to idle workers, and only its: a healthy worker is never taken for a straggler.
        stragglers = [e for e in events if e["kind"] == "straggler"]
        assert stragglers and {e["instance"] for e in stragglers} == {"worker-0"}, stragglers
        assert all(e["holder_records_per_s"] * 4 <= e["idle_records_per_s"] for e in stragglers), stragglers
        assert all("re-leased to worker-" in e["detail"] and e["records"] > 0 for e in stragglers), stragglers
        assert "is a straggler:" in proc.stderr
    # Only the frozen worker: not the slowed one, not one in its long first step, not its replacement in its own.
    assert [(e["instance"], e["bound_s"]) for e in hung] == [("worker-1", HANG_TIMEOUT)], hung
    assert hung[0]["idle_s"] >= HANG_TIMEOUT and "declared hung" in hung[0]["detail"]
    after = [e for e in events if e["t"] >= hung[0]["t"] and e["instance"] == "worker-1"]
    assert any(e["kind"] == "lost" and "declared hung" in e["detail"] for e in after), after
    assert any(e["kind"] == "decision" and e["detail"].startswith("relaunch:") for e in after), after
    # Its replacement started (it may find the job done before it registers: the others trained the rest).
    assert any(e["kind"] == "running" for e in after), after
    if strategy == "ps":  # its lease's remainder went back to the queue (allreduce: when it held one)
        assert any(e["kind"] == "requeued" for e in after), after
    assert "worker-1: no progress for" in proc.stderr and "declared hung" in proc.stderr
    assert summary["workers"]["lost"] == 1 and summary["workers"]["relaunched"] == 1, summary["workers"]
    assert_each_record_applied_exactly(out, tally_data, EPOCHS)
    assert_audit_exact(summary, strategy)
