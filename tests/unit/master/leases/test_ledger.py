"""The task ledger: example tests and a stateful property-based test.

The ledger is the proof of DESIGN.md's first promise (no lost and no double-applied data), so
besides a few worked examples a hypothesis state machine drives it through random interleavings
of leases, minibatch reports, losses, relaunches and completions, and checks after every step
that no record is leased twice at once, none is committed twice and none is skipped.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from elastic_step.errors import ConfigError
from elastic_step.master.leases.ledger import LeaseOver, Ledger, LedgerError, ShardInfo


def _queued(ledger: Ledger) -> list[tuple[str, int, int]]:
    return [(task.shard, start, task.end) for task, start in ledger.queue]


def _drain(ledger: Ledger, worker: str = "w", now: float = 0.0) -> None:
    """Lease and complete everything (one worker, whole tasks)."""
    while not ledger.done:
        lease = ledger.lease(worker, now)
        assert lease is not None, "nothing leasable, yet the job is not done"
        ledger.report(worker, lease.task.task_id, lease.task.end)


# ---------------------------------------------------------------------------- cutting into tasks


def test_tasks_are_aligned_to_the_minibatch_and_cover_every_shard():
    ledger = Ledger([ShardInfo("a", 100), ShardInfo("b", 37)], records_per_task=50, epochs=1, minibatch_size=16)
    # 50 records per task is not a whole number of minibatches: rounded down to 48.
    assert ledger.records_per_task == 48
    assert ledger.records_per_epoch == 137
    by_shard: dict[str, list[tuple[int, int]]] = {}
    for shard, start, end in _queued(ledger):
        by_shard.setdefault(shard, []).append((start, end))
    assert sorted(by_shard["a"]) == [(0, 48), (48, 96), (96, 100)]
    assert sorted(by_shard["b"]) == [(0, 37)]
    for task, start in ledger.queue:
        assert start == task.start and task.start % 16 == 0 and task.epoch == 0


def test_a_lease_taken_ahead_becomes_current_after_the_last_report_and_goes_back_with_a_loss():
    ledger = Ledger([ShardInfo("s", 40)], records_per_task=10, epochs=1, minibatch_size=5)
    current = ledger.lease("w", 0.0)
    ahead = ledger.lease("w", 0.0, after=current.task.task_id)
    assert ahead.task != current.task
    assert ledger.lease("w", 0.0, after=current.task.task_id) is ahead and ledger.lease("w", 0.0) is current
    # The worker starts `ahead` before the master has the current lease's last report: the lease
    # after `ahead` comes once that report is in, and its reports are taken only then too.
    assert ledger.lease("w", 0.0, after=ahead.task.task_id) is None
    with pytest.raises(LedgerError):
        ledger.report("w", ahead.task.task_id, ahead.task.start + 5)
    ledger.report("w", current.task.task_id, current.task.end)
    assert ledger.lease("w", 0.0) is ahead and "w" not in ledger.ahead
    ledger.report("w", ahead.task.task_id, ahead.task.start + 5)
    third = ledger.lease("w", 1.0, after=ahead.task.task_id)
    assert ledger.release("w", 2.0) == (ahead.task.start + 5, ahead.task.end)
    assert list(ledger.queue)[:2] == [(ahead.task, ahead.task.start + 5), (third.task, third.task.start)]
    assert ledger.account.requeued == 5 + 10 and ledger.account.committed == 15
    other = ledger.lease("v", 3.0)
    assert other.task == ahead.task and ledger.requeue_latencies == [1.0]  # one figure per loss


def test_a_task_holds_at_least_one_minibatch():
    ledger = Ledger([ShardInfo("a", 100)], records_per_task=10, epochs=1, minibatch_size=32)
    assert ledger.records_per_task == 32
    assert sorted((s, e) for _, s, e in _queued(ledger)) == [(0, 32), (32, 64), (64, 96), (96, 100)]


def test_a_task_size_of_0_is_32_minibatches_or_fewer_for_at_least_8_tasks_an_epoch():
    """Sized from the minibatch and the epoch alone: a resumed job cuts the same tasks with any number of workers."""
    big = Ledger([ShardInfo("a", 20_000)], records_per_task=0, epochs=1, minibatch_size=64)
    assert big.records_per_task == 32 * 64 and big.tasks_per_epoch == 10
    small = Ledger([ShardInfo("a", 1_437)], records_per_task=0, epochs=1, minibatch_size=64)
    assert small.records_per_task == 128 and small.tasks_per_epoch == 12  # 179 records an eighth, whole minibatches
    tiny = Ledger([ShardInfo("a", 100)], records_per_task=0, epochs=1, minibatch_size=32)
    assert tiny.records_per_task == 32  # never less than a minibatch
    assert Ledger([ShardInfo("a", 20_000)], records_per_task=512, epochs=1, minibatch_size=64).records_per_task == 512


def test_empty_shards_are_skipped_and_no_records_is_a_config_error():
    ledger = Ledger([ShardInfo("empty", 0), ShardInfo("a", 5)], records_per_task=4, epochs=1)
    assert [s.uri for s in ledger.shards] == ["a"]
    with pytest.raises(ConfigError):
        Ledger([ShardInfo("empty", 0)], records_per_task=4, epochs=1)
    for bad in ({"records_per_task": -1}, {"epochs": 0}, {"minibatch_size": 0}):
        kwargs = {"records_per_task": 4, "epochs": 1, "minibatch_size": 1, **bad}
        with pytest.raises(ConfigError):
            Ledger([ShardInfo("a", 5)], **kwargs)


def test_task_ids_are_unique_over_epochs_and_each_epoch_is_reshuffled_deterministically():
    def orders(seed):
        ledger = Ledger([ShardInfo("a", 64)], records_per_task=4, epochs=3, seed=seed)
        seen = []
        while not ledger.done:
            lease = ledger.lease("w", 0.0)
            seen.append((lease.task.epoch, lease.task.task_id, lease.task.start))
            ledger.report("w", lease.task.task_id, lease.task.end)
        return seen

    seen = orders(7)
    assert len({tid for _, tid, _ in seen}) == len(seen) == 48
    per_epoch = [[start for e, _, start in seen if e == epoch] for epoch in range(3)]
    assert all(sorted(p) == list(range(0, 64, 4)) for p in per_epoch)
    assert per_epoch[0] != per_epoch[1]  # a new order per epoch
    assert orders(7) == seen  # same seed, same order


# ---------------------------------------------------------------------------- epochs


def test_epoch_e_plus_1_is_leasable_only_once_epoch_e_is_fully_committed():
    ledger = Ledger([ShardInfo("a", 8)], records_per_task=4, epochs=2, minibatch_size=2)
    a = ledger.lease("wa", 0.0)
    b = ledger.lease("wb", 0.0)
    assert a.task.epoch == b.task.epoch == 0
    assert ledger.lease("wc", 0.0) is None  # the queue is empty, epoch 0 still leased
    ledger.report("wa", a.task.task_id, a.task.end)
    assert ledger.lease("wa", 0.0) is None  # b's task is not committed yet
    ledger.report("wb", b.task.task_id, b.task.end - 2)
    assert ledger.lease("wc", 0.0) is None  # partly committed is not committed
    assert ledger.epoch == 0
    ledger.report("wb", b.task.task_id, b.task.end)
    assert ledger.epoch == 1
    c = ledger.lease("wc", 0.0)
    assert c.task.epoch == 1
    assert ledger.accounts[0].as_dict() == {
        "epoch": 0,
        "records": 8,
        "committed": 8,
        "lost": 0,
        "double_applied": 0,
        "requeued": 0,
    }


def test_done_after_the_last_epoch():
    ledger = Ledger([ShardInfo("a", 10)], records_per_task=3, epochs=2)
    _drain(ledger)
    assert ledger.done and ledger.epoch == 2
    assert ledger.lease("w", 0.0) is None
    assert ledger.records_committed_total() == 20
    assert [a["committed"] for a in ledger.summary()["epochs"]] == [10, 10]


def test_early_stopping_holds_each_epochs_end_for_its_evaluation_and_can_end_training_with_it():
    ledger = Ledger([ShardInfo("a", 10)], records_per_task=5, epochs=5)
    ledger.hold_epochs = True

    def one_epoch():
        while (lease := ledger.lease("w", 0.0)) is not None:
            ledger.report("w", lease.task.task_id, lease.task.end)

    one_epoch()
    assert ledger.awaiting_evaluation and ledger.epoch == 0 and ledger.lease("w", 0.0) is None
    ledger.epoch_evaluated(0, last=False)
    assert not ledger.awaiting_evaluation and ledger.epoch == 1
    one_epoch()
    ledger.epoch_evaluated(1, last=True)
    assert ledger.done and ledger.epochs == 2 and ledger.lease("w", 0.0) is None
    assert [a["committed"] for a in ledger.summary()["epochs"]] == [10, 10]


# ---------------------------------------------------------------------------- leases and reports


def test_a_worker_is_handed_its_current_lease_again():
    ledger = Ledger([ShardInfo("a", 8)], records_per_task=4, epochs=1, minibatch_size=2)
    first = ledger.lease("w", 0.0)
    ledger.report("w", first.task.task_id, first.start + 2)
    again = ledger.lease("w", 5.0)
    assert again is first and again.watermark == first.start + 2 and len(ledger.queue) == 1


def test_reports_commit_records_below_the_watermark():
    ledger = Ledger([ShardInfo("a", 10)], records_per_task=12, epochs=1, minibatch_size=4)
    lease = ledger.lease("w", 0.0)
    assert (lease.task.start, lease.task.end) == (0, 10)
    assert ledger.report("w", lease.task.task_id, 4) == 4
    assert ledger.report("w", lease.task.task_id, 4) == 0  # a repeated report commits nothing
    assert ledger.report("w", lease.task.task_id, 8) == 4
    assert ledger.report("w", lease.task.task_id, 10) == 2  # the last minibatch may be short
    assert "w" not in ledger.leases and ledger.done
    assert ledger.accounts[0].committed == 10 and ledger.accounts[0].double_applied == 0


def test_a_report_from_a_worker_that_does_not_hold_the_lease_raises():
    ledger = Ledger([ShardInfo("a", 8)], records_per_task=4, epochs=1, minibatch_size=2)
    a = ledger.lease("wa", 0.0)
    b = ledger.lease("wb", 0.0)
    with pytest.raises(LedgerError):
        ledger.report("stranger", a.task.task_id, a.start + 2)  # holds nothing
    with pytest.raises(LedgerError):
        ledger.report("wb", a.task.task_id, a.start + 2)  # holds another task
    with pytest.raises(LedgerError):
        ledger.report("wa", 10_000, 2)  # unknown task
    with pytest.raises(LedgerError):
        ledger.report("wa", a.task.task_id, a.task.end + 1)  # past the end
    ledger.report("wa", a.task.task_id, a.start + 2)
    with pytest.raises(LedgerError):
        ledger.report("wa", a.task.task_id, a.start)  # backwards
    # The lost worker's late report is refused: its remainder belongs to the queue now.
    ledger.release("wb", 1.0)
    with pytest.raises(LedgerError):
        ledger.report("wb", b.task.task_id, b.start + 2)
    # A finished lease is gone: one more report on it is refused too.
    ledger.report("wa", a.task.task_id, a.task.end)
    with pytest.raises(LedgerError):
        ledger.report("wa", a.task.task_id, a.task.end)
    assert ledger.accounts[0].committed == 4 and ledger.accounts[0].double_applied == 0


# ---------------------------------------------------------------------------- losses


def test_release_requeues_exactly_the_remainder_at_the_front():
    ledger = Ledger([ShardInfo("a", 40)], records_per_task=10, epochs=1, minibatch_size=5)
    lease = ledger.lease("w", 0.0)
    task = lease.task
    ledger.report("w", task.task_id, task.start + 5)
    before = list(ledger.queue)
    assert ledger.release("w", 2.0) == (task.start + 5, task.end)
    assert ledger.queue[0] == (task, task.start + 5)
    assert list(ledger.queue)[1:] == before
    assert ledger.account.requeued == 5 and ledger.account.committed == 5
    assert ledger.release("w", 3.0) is None  # nothing held any more
    assert ledger.release("never-seen", 3.0) is None
    # The next worker takes the remainder, not the whole task, and finishes the epoch exactly.
    other = ledger.lease("v", 4.0)
    assert other.task is task and other.start == other.watermark == task.start + 5
    ledger.report("v", task.task_id, task.end)
    _drain(ledger)
    acct = ledger.accounts[0]
    assert (acct.committed, acct.lost, acct.double_applied, acct.requeued) == (40, 0, 0, 5)


def test_release_before_any_report_requeues_the_whole_task():
    ledger = Ledger([ShardInfo("a", 20)], records_per_task=10, epochs=1)
    lease = ledger.lease("w", 0.0)
    assert ledger.release("w", 1.0) == (lease.task.start, lease.task.end)
    assert ledger.queue[0] == (lease.task, lease.task.start)


def test_requeue_latency_is_recorded_when_the_remainder_is_leased_again():
    ledger = Ledger([ShardInfo("a", 20)], records_per_task=10, epochs=1, minibatch_size=2)
    lease = ledger.lease("w", 100.0)
    ledger.report("w", lease.task.task_id, lease.start + 2)
    ledger.release("w", 101.5)
    assert ledger.requeue_latencies == []  # not leased again yet
    ledger.lease("v", 104.0)
    assert ledger.requeue_latencies == [pytest.approx(2.5)]
    ledger.lease("u", 105.0)  # a fresh task: no latency
    assert ledger.requeue_latencies == [pytest.approx(2.5)]
    # Clock skew between the event and the lease never gives a negative latency.
    ledger.release("v", 110.0)
    ledger.lease("t", 109.0)
    assert ledger.requeue_latencies == [pytest.approx(2.5), 0.0]


def test_a_stragglers_tail_is_handed_over_under_the_same_task_and_boundaries_and_its_reports_past_the_cut_end_it():
    ledger = Ledger([ShardInfo("a", 20)], records_per_task=20, epochs=1, minibatch_size=2)
    slow = ledger.lease("slow", 0.0)
    ledger.report("slow", slow.task.task_id, 4)
    tail = ledger.hand_over("slow", "fast", 1.0, cut=10)
    assert (tail.task.task_id, tail.task.start, tail.start, tail.task.end) == (slow.task.task_id, 0, 10, 20)
    assert ledger.leases["slow"].task.end == 10  # the straggler keeps [4, 10)
    with pytest.raises(LedgerError):
        ledger.hand_over("slow", "other", 1.0, cut=7)  # off the minibatch boundaries
    ledger.report("fast", tail.task.task_id, 14)
    with pytest.raises(LeaseOver):  # the straggler trained on past its cut: up to the cut is its
        ledger.report("slow", slow.task.task_id, 12)
    assert ledger.accounts[0].committed == 14 and "slow" not in ledger.leases
    with pytest.raises(LeaseOver):  # and its later reports of that task are refused the same way
        ledger.report("slow", slow.task.task_id, 16)
    ledger.report("fast", tail.task.task_id, 20)
    assert ledger.done and ledger.accounts[0].committed == 20 and ledger.accounts[0].double_applied == 0


def test_a_stragglers_lease_ahead_is_handed_over_whole_and_a_cut_short_lease_survives_a_checkpoint():
    ledger = Ledger([ShardInfo("a", 30)], records_per_task=10, epochs=1, minibatch_size=2)
    slow = ledger.lease("slow", 0.0)
    ahead = ledger.lease("slow", 0.0, after=slow.task.task_id)
    assert ledger.hand_over("slow", "fast", 1.0) is ahead and "slow" not in ledger.ahead
    with pytest.raises(LedgerError):
        ledger.hand_over("slow", "fast", 1.0, cut=slow.task.start + 4)  # "fast" holds a lease now
    task = slow.task
    ledger.hand_over("slow", "third", 1.0, cut=task.start + 4)
    restored = Ledger([ShardInfo("a", 30)], records_per_task=10, epochs=1, minibatch_size=2)
    restored.restore(json.loads(json.dumps(ledger.cut())))
    # Every record outstanding once: the straggler's lease ends at its cut, the tail is whole.
    outstanding = sorted((t.task_id, start, t.end) for t, start in restored.queue)
    assert outstanding == sorted(
        [
            (task.task_id, task.start, task.start + 4),
            (task.task_id, task.start + 4, task.end),
            (ahead.task.task_id, ahead.task.start, ahead.task.end),
            *[(t.task_id, s, t.end) for t, s in ledger.queue],
        ]
    )
    _drain(restored)
    assert restored.accounts[0].committed == 30 and restored.accounts[0].double_applied == 0


def test_the_same_worker_name_relaunched_after_a_loss_resumes_at_the_watermark():
    ledger = Ledger([ShardInfo("a", 8)], records_per_task=8, epochs=1, minibatch_size=2)
    lease = ledger.lease("worker-0", 0.0)
    ledger.report("worker-0", lease.task.task_id, 4)
    ledger.release("worker-0", 1.0)
    again = ledger.lease("worker-0", 2.0)  # relaunched under the same name
    assert again is not lease and again.task is lease.task and again.start == 4
    ledger.report("worker-0", again.task.task_id, 8)
    assert ledger.done and ledger.accounts[0].committed == 8 and ledger.accounts[0].double_applied == 0


# ---------------------------------------------------------------------------- property-based


class LedgerMachine(RuleBasedStateMachine):
    """Random leases / minibatch reports / losses / relaunches against a shadow model.

    Workers are names; a lost worker is released at once (the backend's event) and may be
    relaunched under the same name or replaced by a new one. The shadow holds every committed
    (epoch, shard, record) and the task that committed it.
    """

    @initialize(
        rows=st.lists(st.integers(0, 32), min_size=1, max_size=3),
        minibatch=st.integers(1, 8),
        minibatches_per_task=st.integers(0, 6),
        extra=st.integers(0, 7),
        epochs=st.integers(1, 3),
        seed=st.integers(0, 3),
        workers=st.integers(1, 4),
    )
    def setup(self, rows, minibatch, minibatches_per_task, extra, epochs, seed, workers):
        rows = rows if any(rows) else rows + [1]
        # Not always a whole number of minibatches: the ledger rounds down (to at least one).
        records_per_task = max(1, minibatch * minibatches_per_task + extra % minibatch)
        self.rows = {f"s{i}": n for i, n in enumerate(rows)}
        self.minibatch = minibatch
        self.epochs = epochs
        self.ledger = Ledger(
            [ShardInfo(uri, n) for uri, n in self.rows.items()],
            records_per_task,
            epochs,
            minibatch_size=minibatch,
            seed=seed,
        )
        self.records = sum(rows)
        self.now = 0.0
        self.alive: list[str] = [f"w{n}" for n in range(workers)]
        self.lost: list[str] = []  # names that may be relaunched
        self.next_name = workers
        self.stale: dict[str, tuple[int, int]] = {}  # lost worker -> (task_id, a watermark it could send)
        self.shadow: dict[tuple[int, str, int], int] = {}  # (epoch, shard, record) -> task_id
        self.requeued = [0] * epochs
        self.lost_at: dict[int, float] = {}
        self.latencies: list[float] = []
        self.epoch_seen = 0
        self.steps = 0
        self.partial_losses = 0  # losses after some but not all of a lease was committed
        self.ahead_losses = 0  # losses of a worker holding a lease ahead

    # ------------------------------------------------------------------ helpers
    def _holder(self, i: int) -> str | None:
        holders = [w for w in self.alive if w in self.ledger.leases]
        return holders[i % len(holders)] if holders else None

    def _apply_report(self, worker: str, watermark: int) -> None:
        lease = self.ledger.leases[worker]
        ahead = self.ledger.ahead.get(worker)
        task, old = lease.task, lease.watermark
        epoch_before = self.ledger.epoch
        fresh = self.ledger.report(worker, task.task_id, watermark)
        assert fresh == watermark - old
        for r in range(old, watermark):
            key = (task.epoch, task.shard, r)
            assert key not in self.shadow, f"record {key} committed twice"
            self.shadow[key] = task.task_id
        if watermark == task.end:  # the lease taken ahead, if any, is now the current one
            assert self.ledger.leases.get(worker) is ahead and worker not in self.ledger.ahead
        else:
            assert self.ledger.leases[worker].watermark == watermark
        if self.ledger.epoch != epoch_before:
            self._check_epoch_complete(epoch_before)

    def _check_epoch_complete(self, epoch: int) -> None:
        expected = {(epoch, uri, r) for uri, n in self.rows.items() for r in range(n)}
        got = {k for k in self.shadow if k[0] == epoch}
        assert got == expected, f"epoch {epoch}: skipped {sorted(expected - got)[:5]}"
        acct = self.ledger.accounts[epoch]
        assert (acct.committed, acct.lost, acct.double_applied) == (self.records, 0, 0)
        assert acct.requeued == self.requeued[epoch]

    def _lease(self, worker: str, ahead: bool = False):
        """A lease as the worker asks for it: its current one, or (`ahead`) the one after that."""
        current = self.ledger.leases.get(worker)
        held = self.ledger.ahead.get(worker) if ahead and current is not None else current
        queue_before = list(self.ledger.queue)
        lease = self.ledger.lease(
            worker, self.now, after=current.task.task_id if ahead and current else (-1 if ahead else None)
        )
        if held is not None:
            assert lease is held
            return lease
        if lease is None:
            assert self.ledger.done or not queue_before
            return None
        task, start = queue_before[0]  # always from the front
        assert (lease.task, lease.start, lease.watermark, lease.worker) == (task, start, start, worker)
        assert lease.task.epoch == self.ledger.epoch
        assert all(a.committed == a.records for a in self.ledger.accounts[: task.epoch])
        if ahead and current is not None:
            assert self.ledger.ahead[worker] is lease and self.ledger.leases[worker] is current
        else:
            assert self.ledger.leases[worker] is lease
        if task.task_id in self.lost_at:
            self.latencies.append(max(0.0, self.now - self.lost_at.pop(task.task_id)))
        assert self.ledger.requeue_latencies == pytest.approx(self.latencies)
        return lease

    def _lose(self, worker: str) -> None:
        """The backend says the worker is gone: its remainder goes back at once."""
        self.alive.remove(worker)
        self.lost.append(worker)
        held = self.ledger.leases.get(worker)
        ahead = self.ledger.ahead.get(worker)
        queue_before = list(self.ledger.queue)
        got = self.ledger.release(worker, self.now)
        assert worker not in self.ledger.leases and worker not in self.ledger.ahead
        if held is None:
            assert ahead is None and got is None and list(self.ledger.queue) == queue_before
            return
        assert got == (held.watermark, held.task.end)
        # Both go back to the front, the current lease's remainder first; only its latency is measured.
        assert (
            list(self.ledger.queue)
            == [(held.task, held.watermark)] + ([(ahead.task, ahead.start)] if ahead else []) + queue_before
        )
        self.requeued[held.task.epoch] += held.task.end - held.watermark
        if ahead is not None:
            self.ahead_losses += 1
            assert ahead.watermark == ahead.start  # never reported: a lease ahead is not started
            self.requeued[ahead.task.epoch] += ahead.task.end - ahead.start
        self.partial_losses += held.watermark > held.start
        self.lost_at[held.task.task_id] = self.now
        self.stale[worker] = (held.task.task_id, min(held.task.end, held.watermark + self.minibatch))

    # ------------------------------------------------------------------ rules
    @rule(i=st.integers(0, 100), minibatches=st.integers(1, 3), dt=st.floats(0.0, 5.0))
    def work(self, i, minibatches, dt):
        """A live worker asks for a task, or reports the next minibatch(es) of the one it holds."""
        self.now += dt
        if not self.alive:
            return
        worker = self.alive[i % len(self.alive)]
        lease = self.ledger.leases.get(worker)
        if lease is None:
            self._lease(worker)
        else:
            self._apply_report(worker, min(lease.task.end, lease.watermark + minibatches * self.minibatch))

    @rule(i=st.integers(0, 100))
    def take_ahead(self, i):
        """A live worker asks for the lease it will start after its current one (and asks again)."""
        if not self.alive:
            return
        worker = self.alive[i % len(self.alive)]
        had_current = worker in self.ledger.leases
        first = self._lease(worker, ahead=True)  # without a current lease: the current one
        again = self._lease(worker, ahead=True)
        if had_current:
            assert again is first
        # Ahead of a lease that is not its current one yet (its last report still on the way): nothing.
        current, held, queue = self.ledger.leases.get(worker), self.ledger.ahead.get(worker), list(self.ledger.queue)
        if current is not None:
            assert self.ledger.lease(worker, self.now, after=current.task.task_id + 10**6) is None
            assert (self.ledger.leases.get(worker), self.ledger.ahead.get(worker)) == (current, held)
            assert list(self.ledger.queue) == queue

    @rule(i=st.integers(0, 100), take_next=st.booleans())
    def complete(self, i, take_next):
        """A holder reports its lease's end in one go (possibly a short last minibatch)."""
        worker = self._holder(i)
        if worker is None:
            return
        self._apply_report(worker, self.ledger.leases[worker].task.end)
        if take_next:
            self._lease(worker)

    @rule()
    def every_live_worker_completes_and_takes_the_next(self):
        """A round of the whole fleet: moves through epochs fast, losses stay interleaved."""
        for worker in list(self.alive):
            if worker in self.ledger.leases:
                self._apply_report(worker, self.ledger.leases[worker].task.end)
            self._lease(worker)

    @rule(i=st.integers(0, 100), lease_first=st.booleans(), minibatches=st.integers(0, 3), dt=st.floats(0.0, 5.0))
    def lose_worker(self, i, lease_first, minibatches, dt):
        """A live worker (maybe after taking a lease and pushing some minibatches short of its
        end) is lost."""
        self.now += dt
        if not self.alive:
            return
        worker = self.alive[i % len(self.alive)]
        lease = self._lease(worker) if lease_first else self.ledger.leases.get(worker)
        if lease is not None:
            watermark = lease.watermark + minibatches * self.minibatch
            if watermark < lease.task.end:
                self._apply_report(worker, watermark)
        self._lose(worker)

    @rule(same_name=st.booleans(), i=st.integers(0, 100))
    def relaunch(self, same_name, i):
        """A replacement starts: under a lost worker's name, or a new one (scale-out)."""
        if same_name and self.lost:
            self.alive.append(self.lost.pop(i % len(self.lost)))
        elif len(self.alive) < 6:
            self.alive.append(f"w{self.next_name}")
            self.next_name += 1

    @rule(i=st.integers(0, 100), j=st.integers(0, 100), cut_at=st.integers(1, 6), past=st.integers(0, 3))
    def hand_over(self, i, j, cut_at, past):
        """A straggler's work goes to an idle worker: its lease ahead, or its current lease's tail from a cut; then,
        perhaps, the straggler reports `past` minibatches beyond its cut, not knowing yet."""
        holder = self._holder(i)
        idle = [w for w in self.alive if w not in self.ledger.leases]
        if holder is None or not idle:
            return
        to, lease, ahead = idle[j % len(idle)], self.ledger.leases[holder], self.ledger.ahead.get(holder)
        if ahead is not None:
            got = self.ledger.hand_over(holder, to, self.now)
            assert got is ahead and self.ledger.leases[to] is ahead and holder not in self.ledger.ahead
            return
        task, cut = lease.task, lease.watermark + cut_at * self.minibatch
        if cut >= task.end:
            with pytest.raises(LedgerError):
                self.ledger.hand_over(holder, to, self.now, cut=cut)
            return
        got = self.ledger.hand_over(holder, to, self.now, cut=cut)
        assert (got.task.task_id, got.task.start, got.start, got.task.end) == (task.task_id, task.start, cut, task.end)
        assert self.ledger.leases[holder].task.end == cut
        if past:
            old = self.ledger.leases[holder].watermark
            with pytest.raises(LeaseOver):
                self.ledger.report(holder, task.task_id, min(task.end, cut + past * self.minibatch))
            for r in range(old, cut):  # what it trained below the cut is committed, the rest is not
                self.shadow[(task.epoch, task.shard, r)] = task.task_id
            assert holder not in self.ledger.leases or self.ledger.leases[holder].task.task_id != task.task_id

    @rule()
    def checkpoint_round_trip(self):
        """A cut, restored into a fresh ledger (a restarted master), is the same ledger: its own cut is the same, and
        it has outstanding exactly what was held or queued, under the same task ids."""
        cut = json.loads(json.dumps(self.ledger.cut()))
        restored = Ledger(
            self.ledger.shards, self.ledger.records_per_task, self.epochs, self.minibatch, seed=self.ledger.seed
        )
        restored.restore(cut)
        assert restored.cut() == cut
        held = [(x.task, x.watermark) for x in [*self.ledger.leases.values(), *self.ledger.ahead.values()]]
        assert [(t.task_id, t.shard, s, t.end) for t, s in restored.queue] == [
            (t.task_id, t.shard, s, t.end) for t, s in [*held, *self.ledger.queue]
        ]
        assert [a.as_dict() for a in restored.accounts] == [a.as_dict() for a in self.ledger.accounts]
        assert (restored.epoch, restored.done) == (self.ledger.epoch, self.ledger.done)

    @rule(
        kind=st.sampled_from(["repeat", "lost", "stranger"]),
        i=st.integers(0, 100),
        task_id=st.integers(0, 400),
        watermark=st.integers(0, 200),
    )
    def odd_report(self, kind, i, task_id, watermark):
        """A repeated report commits nothing; a lost worker's late report and a report on a
        task the worker does not hold are refused without touching the ledger."""
        committed = self.ledger.records_committed_total()
        if kind == "repeat":
            worker = self._holder(i)
            if worker is None:
                return
            lease = self.ledger.leases[worker]
            assert self.ledger.report(worker, lease.task.task_id, lease.watermark) == 0
        elif kind == "lost":
            zombies = [w for w in self.lost if w in self.stale]
            if not zombies:
                return
            worker = zombies[i % len(zombies)]
            with pytest.raises(LedgerError):
                self.ledger.report(worker, *self.stale[worker])
        else:
            worker = (self.alive + ["stranger"])[i % (len(self.alive) + 1)]
            lease = self.ledger.leases.get(worker)
            if lease is not None and lease.task.task_id == task_id:
                return
            with pytest.raises(LedgerError):
                self.ledger.report(worker, task_id, watermark)
        assert self.ledger.records_committed_total() == committed

    # ------------------------------------------------------------------ invariants
    @invariant()
    def accounts_never_exceed_and_never_double_apply(self):
        self.steps += 1
        for acct in self.ledger.accounts:
            assert 0 <= acct.committed <= acct.records == self.records
            assert acct.double_applied == 0
        assert len(self.shadow) == self.ledger.records_committed_total()

    @invariant()
    def no_record_is_leased_twice_or_both_queued_and_leased(self):
        ranges: dict[str, list[tuple[int, int, str]]] = {}
        assert set(self.ledger.ahead) <= set(self.ledger.leases)  # ahead only of a current lease
        for worker, lease in [*self.ledger.leases.items(), *self.ledger.ahead.items()]:
            assert lease.worker == worker
            assert lease.task.start <= lease.start <= lease.watermark < lease.task.end
            ranges.setdefault(lease.task.shard, []).append((lease.watermark, lease.task.end, worker))
        for task, start in self.ledger.queue:
            assert task.start <= start < task.end
            ranges.setdefault(task.shard, []).append((start, task.end, "queue"))
        for shard, rs in ranges.items():
            rs.sort()
            for (_, e1, who1), (s2, _, who2) in zip(rs, rs[1:]):
                assert e1 <= s2, f"{shard}: [{s2},{e1}) held by {who1} and {who2}"

    @invariant()
    def outstanding_records_are_conserved(self):
        if self.ledger.done:
            assert not self.ledger.queue and not self.ledger.leases and not self.ledger.ahead
            return
        epoch = self.ledger.epoch
        queued = sum(task.end - start for task, start in self.ledger.queue)
        leased = sum(
            lease.task.end - lease.watermark for lease in [*self.ledger.leases.values(), *self.ledger.ahead.values()]
        )
        assert self.ledger.account.committed + queued + leased == self.records
        assert all(t.epoch == epoch for t, _ in self.ledger.queue)
        everything_leased = [*self.ledger.leases.values(), *self.ledger.ahead.values()]
        assert all(lease.task.epoch == epoch for lease in everything_leased)
        # The shadow agrees with the ledger record by record: nothing uncommitted is outstanding twice.
        outstanding = {(task.shard, r) for task, start in self.ledger.queue for r in range(start, task.end)}
        outstanding |= {
            (lease.task.shard, r) for lease in everything_leased for r in range(lease.watermark, lease.task.end)
        }
        committed = {(shard, r) for (e, shard, r) in self.shadow if e == epoch}
        assert not outstanding & committed
        assert len(outstanding) + len(committed) == self.records

    @invariant()
    def watermarks_sit_on_minibatch_boundaries(self):
        for lease in [*self.ledger.leases.values(), *self.ledger.ahead.values()]:
            t = lease.task
            assert (lease.watermark - t.start) % self.minibatch == 0
            assert t.start % self.minibatch == 0 and (t.end - t.start) <= self.ledger.records_per_task
        for task, start in self.ledger.queue:
            assert (start - task.start) % self.minibatch == 0

    @invariant()
    def epochs_only_move_forward_one_committed_epoch_at_a_time(self):
        assert self.ledger.epoch >= self.epoch_seen
        for e in range(self.epoch_seen, min(self.ledger.epoch, self.epochs)):
            self._check_epoch_complete(e)
        self.epoch_seen = self.ledger.epoch

    # ------------------------------------------------------------------ the end: finish the job
    def teardown(self):
        if not hasattr(self, "ledger"):
            return
        event(f"steps: {'<20' if self.steps < 20 else '20-39' if self.steps < 40 else '40+'}")
        event(f"epochs finished by the rules: {min(self.ledger.epoch, self.epochs)} of {self.epochs}")
        event(f"losses mid-lease: {min(self.partial_losses, 3)}{'+' if self.partial_losses >= 3 else ''}")
        event(f"losses holding a lease ahead: {min(self.ahead_losses, 2)}{'+' if self.ahead_losses >= 2 else ''}")
        # Whatever happened, the job can be finished: live holders complete, a fresh worker drains.
        for worker in list(self.alive):
            while worker in self.ledger.leases:  # the current lease, then the one taken ahead
                self._apply_report(worker, self.ledger.leases[worker].task.end)
        for _ in range(10 * self.ledger.tasks_per_epoch * self.epochs + 10):
            if self.ledger.done:
                break
            lease = self._lease("drain")
            assert lease is not None, "stuck: nothing leasable, nothing leased, not done"
            self._apply_report("drain", lease.task.end)
        assert self.ledger.done and not self.ledger.leases and not self.ledger.queue
        assert len(self.ledger.accounts) == self.epochs
        for epoch, acct in enumerate(self.ledger.accounts):
            assert acct.committed == self.ledger.records_per_epoch == self.records
            assert acct.lost == 0 and acct.double_applied == 0
            assert acct.requeued == self.requeued[epoch]
            self._check_epoch_complete(epoch)
        assert len(self.shadow) == self.records * self.epochs
        assert self.ledger.requeue_latencies == pytest.approx(self.latencies)


LedgerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestLedgerMachine = LedgerMachine.TestCase


def test_a_cut_restores_into_a_fresh_ledger_with_held_leases_requeued_under_their_task_ids():
    shards = [ShardInfo("a", 100), ShardInfo("b", 60)]
    ledger = Ledger(shards, records_per_task=32, epochs=3, minibatch_size=16)
    while ledger.epoch == 0:  # one whole epoch, then part of the next
        lease = ledger.lease("w0", 0.0)
        ledger.report("w0", lease.task.task_id, lease.task.end)
    lease = ledger.lease("w0", 0.0)
    ledger.report("w0", lease.task.task_id, lease.task.start + 16)
    ahead = ledger.lease("w0", 0.0, after=lease.task.task_id)
    cut = ledger.cut()
    committed = ledger.records_committed_total()
    assert committed == 160 + 16

    # The old ledger goes on past the cut; the new one (a restarted master) starts from the cut.
    ledger.report("w0", lease.task.task_id, lease.task.end)
    restored = Ledger(shards, records_per_task=32, epochs=3, minibatch_size=16)
    restored.restore(json.loads(json.dumps(cut)))
    assert restored.records_committed_total() == committed and restored.epoch == 1
    again = restored.lease("w1", 0.0)
    assert (again.task.task_id, again.start) == (lease.task.task_id, lease.task.start + 16)
    assert restored.lease("w2", 0.0).task.task_id == ahead.task.task_id
    assert ledger.restore(cut) == lease.task.end - lease.task.start - 16  # what the old one committed after
    # It finishes exactly: every record of every epoch once.
    for worker in ("w1", "w2"):
        while held := restored.held(worker):
            restored.report(worker, held[0].task.task_id, held[0].task.end)
    while not restored.done:
        lease = restored.lease("w1", 0.0)
        restored.report("w1", lease.task.task_id, lease.task.end)
    assert [a.committed for a in restored.accounts] == [160, 160, 160]
    assert all(a.double_applied == 0 for a in restored.accounts)


def test_a_cut_of_thousands_of_tasks_in_every_state_round_trips_exactly():
    """Tasks whole, partly committed, held, held ahead, handed over and put back, over many shards: the restored
    ledger cuts the same, and finishes the epoch with every record committed once."""
    shards = [ShardInfo(f"s{i}", 1000 + 37 * i) for i in range(40)]
    ledger = Ledger(shards, records_per_task=20, epochs=2, minibatch_size=4, seed=3)
    assert ledger.tasks_per_epoch > 2000
    for _ in range(900):  # whole tasks
        lease = ledger.lease("w", 0.0)
        ledger.report("w", lease.task.task_id, lease.task.end)
    for i in range(60):  # part of a task each, some lost, some holding a lease ahead
        lease = ledger.lease(f"p{i}", 0.0)
        ledger.report(f"p{i}", lease.task.task_id, min(lease.task.end, lease.start + 4 * (i % 4)))
        if i % 3 == 0:
            ledger.lease(f"p{i}", 0.0, after=lease.task.task_id)
        if i % 5 == 0:
            ledger.release(f"p{i}", 1.0)
    slow = next(x for x in ledger.leases.values() if x.worker not in ledger.ahead and x.watermark + 8 < x.task.end)
    ledger.hand_over(slow.worker, "idle", 2.0, cut=slow.watermark + 8)
    cut = json.loads(json.dumps(ledger.cut()))

    restored = Ledger(shards, records_per_task=20, epochs=2, minibatch_size=4, seed=3)
    assert restored.restore(cut) == 0
    assert restored.cut() == cut
    held = [(x.task, x.watermark) for x in [*ledger.leases.values(), *ledger.ahead.values()]]
    outstanding = [(t.task_id, t.shard, s, t.end) for t, s in [*held, *ledger.queue]]
    assert [(t.task_id, t.shard, s, t.end) for t, s in restored.queue] == outstanding
    committed = ledger.records_committed_total()
    assert restored.records_committed_total() == committed
    assert committed + sum(end - s for _, _, s, end in outstanding) == ledger.records_per_epoch
    seen = set()
    while restored.epoch == 0:
        lease = restored.lease("w", 0.0)
        seen |= {(lease.task.shard, r) for r in range(lease.start, lease.task.end)}
        restored.report("w", lease.task.task_id, lease.task.end)
    assert len(seen) == ledger.records_per_epoch - committed  # nothing outstanding twice
    assert restored.accounts[0].committed == ledger.records_per_epoch and restored.accounts[0].double_applied == 0


def test_a_cut_of_an_earlier_format_or_of_other_data_is_refused_clearly():
    shards = [ShardInfo("a", 100)]
    cut = Ledger(shards, records_per_task=10, epochs=1).cut()
    with pytest.raises(ConfigError, match="format 1.*--resume never"):
        Ledger(shards, records_per_task=10, epochs=1).restore({k: v for k, v in cut.items() if k != "format"})
    with pytest.raises(ConfigError, match="other data or another records_per_task"):
        Ledger([ShardInfo("a", 100)], records_per_task=20, epochs=1).restore(cut)
