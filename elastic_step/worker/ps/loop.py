"""The worker's task loop: lease, read, compute, push, report — pipelined around one training thread.

Only the compiled step runs on the training thread, as in Keras's fit with a prefetching input
pipeline:
  * the next lease is taken ahead, read and fed (the user's feed(), once for the whole lease) on
    its own thread while the current one trains; each minibatch is a slice of it taken inside
    the compiled step;
  * the push of minibatch t travels, and the fresh weights are loaded, on a push thread while t+1
    computes (async SGD tolerates that staleness); or, for a model without embedding tables and a
    worker training alone, several minibatches go in one call on the worker's copies of the shards,
    which the shards' updates keep in step with them (trainer.py), and a call's push travels while the
    next call computes;
  * watermarks go to the master without waiting for the answer.
All of them are long-lived threads (gRPC's own futures would start a thread per call).
None of it weakens exactly-once: a pushed-but-unreported minibatch is re-pushed under the same
(task, seq) key by whoever takes the remainder, and the PS skips it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from elastic_step import fault_hooks as faults
from elastic_step.data.accounting import minibatch_end
from elastic_step.instance.master_client import MasterClient
from elastic_step.proto import elastic_pb2 as pb
from elastic_step.ps.api import PushKey
from elastic_step.ps.client import ShardsMoved
from elastic_step.util.phases import phase
from elastic_step.worker.records import Records, working_on

log = logging.getLogger("elastic_step.worker")

# Pushes in flight per worker unless the master says otherwise (RegisterResponse: the job's
# --pushes-in-flight). One keeps a lone worker's SGD sequential, as fit's. Two let the worker's
# compute and the PS's update overlap (throughput bound by the slower of the two, not by their sum
# plus a round trip), at the cost of one more of its own updates missing from each gradient.
PUSH_DEPTH = 1

# Watermarks go to the master at most this often, and at every lease's end. A report is an RPC on
# both sides; a coarser watermark costs only a few more re-pushed minibatches after a loss, and the
# PS skips those as duplicates. The master may ask for a slower pace (RegisterResponse) in a large job.
REPORT_INTERVAL_S = 0.05

# A lease taken ahead is asked for again after this (doubling up to AHEAD_RETRY_MAX_S) while the
# master cannot give one yet: the current lease's last report is on its way, or the queue is empty.
AHEAD_RETRY_S = 0.005
AHEAD_RETRY_MAX_S = 0.5

COMPUTE = "train: compute (the step's call)"  # a phase of the profile (util/phases.py)


class Reporter:
    """Sends progress reports in order, one in flight at a time; what queues up meanwhile is
    coalesced, since a task's last watermark commits every record below it. A lease's last report
    goes without waiting for the pace: the master moves the worker on to its lease ahead then, so
    it goes as soon as the report before it is answered, not at the training thread's next pump."""

    def __init__(
        self,
        master: MasterClient,
        interval_s: float = REPORT_INTERVAL_S,
        spent: Callable[[], tuple[float, float]] = lambda: (0.0, 0.0),
    ):
        """`spent()`: the worker's time so far computing its steps and waiting on the shards, sent with each report."""
        self.master = master
        self.spent = spent
        self.interval_s = interval_s
        self.pending: list[tuple] = []
        self.in_flight: concurrent.futures.Future | None = None
        self.refused = False
        self.hold = False  # the master is cutting a checkpoint: settle, flush, then hold
        self._sent_at = 0.0
        self._urgent = False  # a lease's last report is pending
        self._ends: dict[int, int] = {}  # task -> its last watermark, once reported
        self._finished: set[int] = set()  # tasks whose last report the master answered
        self._answered = threading.Condition()
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="report")
        self._lock = threading.RLock()  # the training thread's calls, and an answer's callback (report thread)

    def report(
        self, task_id: int, watermark: int, records: int, loss: float, duplicate: bool, last: bool = False
    ) -> None:
        with self._lock:
            self.pending.append((task_id, watermark, records, loss, duplicate))
            self._urgent = self._urgent or last
            if last:
                self._ends[task_id] = watermark
            self.pump()

    def wait_finished(self, task_id: int, leaving: threading.Event, timeout_s: float = 5.0) -> bool:
        """Until the master has answered task `task_id`'s last report (True: it has moved this worker on to the
        lease it took ahead), `leaving` is set or `timeout_s` passed. From any thread."""
        deadline = time.monotonic() + timeout_s
        with self._answered:
            while task_id not in self._finished and not leaving.is_set() and time.monotonic() < deadline:
                self._answered.wait(0.05)  # `leaving` is an Event of its own: looked at this often
            if task_id in self._finished:
                self._finished.discard(task_id)
                return True
            return False

    def pump(self, block: bool = False) -> None:
        with self._lock:
            self._pump(block)

    def _pump(self, block: bool) -> None:
        if self.in_flight is not None:
            if not block and not self.in_flight.done():
                return
            reply = self.in_flight.result()
            self.refused = self.refused or reply.stop
            self.hold = self.hold or reply.hold
            self.in_flight = None
        if self.pending and not self.refused:
            if not block and not self._urgent and time.monotonic() - self._sent_at < self.interval_s:
                return
            self._sent_at = time.monotonic()
            first, *rest = coalesce(self.pending)
            self.pending = rest
            self._urgent = self._urgent and bool(rest)
            last = self._ends.get(first[0]) == first[1]  # the task's last report (not an earlier duplicate)
            if last:
                del self._ends[first[0]]
            self.in_flight = self._thread.submit(self._send, first, last)
            self.in_flight.add_done_callback(self._next_urgent)
        elif self.refused:
            self.pending.clear()

    def _next_urgent(self, _answered: concurrent.futures.Future) -> None:
        """A report was answered: a lease's last report waiting behind it goes now. Never waits for the lock
        (its holder pumps anyway; a flush holding it may be waiting for the next report, on this thread)."""
        if self._urgent and self._lock.acquire(blocking=False):
            try:
                self._pump(False)
            finally:
                self._lock.release()

    def _send(self, report: tuple, last: bool):
        with phase("report thread: ReportProgress"):
            reply = self.master.report(*report, *self.spent())
        if last and not reply.stop:
            with self._answered:
                self._finished.add(report[0])
                self._answered.notify_all()
        return reply

    def flush(self) -> None:
        with self._lock:
            while self.in_flight is not None or self.pending:
                self._pump(True)

    def drop(self) -> None:
        """Forget what is pending: the master rewound the ledger past it (a lost PS)."""
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        self.pending.clear()
        self._ends.clear()
        if self.in_flight is not None:
            with contextlib.suppress(Exception):
                self.in_flight.result()
            self.in_flight = None
        self.refused = self.hold = self._urgent = False

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def coalesce(items: list[tuple]) -> list[tuple]:
    """Consecutive reports of one task become one. Duplicate minibatches stay separate, since
    the master counts them one by one."""
    out: list[tuple] = []
    for task_id, watermark, records, loss, duplicate in items:
        if out and out[-1][0] == task_id and not duplicate and not out[-1][4]:
            _, _, r0, l0, _ = out[-1]
            out[-1] = (task_id, watermark, r0 + records, (l0 * r0 + loss * records) / (r0 + records), False)
        else:
            out.append((task_id, watermark, records, loss, duplicate))
    return out


def minibatches(task, size: int) -> list[tuple[int, int]]:
    """[seq, hi) of each push of a lease: `size` records (a minibatch, or --minibatches-per-push of
    them). Boundaries are fixed by the task's own start, so a remainder leased after a loss pushes
    the same (task, seq) keys the lost worker did."""
    out, seq = [], task.start
    while seq < task.end:
        hi = minibatch_end(task.task_start, task.end, seq, size)
        out.append((seq, hi))
        seq = hi
    return out


class TaskLoop:
    """The task loop of one worker: trains until the master says DONE or `stop` is set (`run`). When the shards
    move (a PS lost, every shard restored to a checkpoint), `rejoin()` waits for them and reconnects.

    Its state is what the loop shares between its steps: the lease being trained, the lease asked for ahead of it,
    the pushes in flight and the reports behind them."""

    def __init__(
        self,
        master: MasterClient,
        trainer,
        readers,
        records_per_push: int,
        stop: threading.Event,
        report_interval_s: float = REPORT_INTERVAL_S,
        pushes_in_flight: int = PUSH_DEPTH,
        rejoin=None,
    ):
        self.master, self.trainer, self.readers = master, trainer, readers
        self.records_per_push, self.stop, self.pushes_in_flight = records_per_push, stop, pushes_in_flight
        self.rejoin = rejoin
        self.step_s = self.wait_s = 0.0  # this launch's time computing its steps, and waiting on the shards
        self.reporter = Reporter(master, report_interval_s, spent=lambda: (self.step_s, self.wait_s))
        # The next lease is asked for and read on its own thread while the current one trains: at the current one's
        # end the worker goes straight on, instead of waiting for its last push and report, a GetTask and a read
        # (several minibatches' worth of time for a small model).
        self.prefetch = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease-ahead")
        # (handle, task_id, its minibatches [(seq, hi), ...], whether the last is the lease's last), oldest first
        self.in_flight: collections.deque = collections.deque()
        self.ahead: concurrent.futures.Future | None = None  # of lease_ahead()
        self.task = None  # the lease being trained
        self.traced = False  # the step has been traced (its first call, before the first commit)
        self.leaving = threading.Event()  # set when the worker leaves the lease it asked ahead of
        self.waited = False  # for work: others pushed meanwhile, so this worker's values are old

    def run(self) -> str:
        """Train until the master says DONE ("done") or `stop` is set ("stopped")."""
        try:
            while not self.stop.is_set():
                try:
                    taken = self.take_lease()
                    if taken == "done":
                        return "done"
                    if taken is not None:
                        self.train_lease(*taken)
                except ShardsMoved as e:
                    if self.rejoin is None:
                        raise
                    log.warning(
                        "the PS shards moved (%s): dropping my leases and pushes in flight, then registering again",
                        str(e).splitlines()[0][:200],
                    )
                    self.drop_everything()
                    self.ahead = None
                    self.rejoin()
            return "stopped"
        finally:
            self.finish()

    def take_lease(self):
        """The next lease (`task`) as (its fed rows, the task trained before it whose last report may still be on its
        way, or None); "done" when the master has no more; None while it has none yet."""
        # Reports arrive in order, so the master takes the next lease's once this one's last is in.
        self.waited = self.waited or (self.ahead is not None and not self.ahead.done())
        with phase("train: wait for the lease ahead"):
            nxt = self.ahead.result() if self.ahead is not None else None
        self.ahead = None
        if nxt is not None and not self.reporter.refused:
            before = self.task.task_id  # its last report may still be on its way
            self.task, fed = nxt
            return fed, before
        # The master hands a worker its current lease again until the lease's last report arrives, so deliver
        # every report before asking for more work.
        with phase("train: no lease ahead: settle, flush reports"):
            self.settle()
            self.reporter.flush()
        if self.reporter.refused:
            # The master no longer counts the lease ours (it thought us lost): start afresh.
            log.warning("master refused a progress report: dropping the lease")
            self.reporter.refused = False
        with phase("train: no lease ahead: GetTask"):
            reply = self.master.get_task()
        if reply.kind == pb.GetTaskResponse.DONE:
            return "done"
        if reply.kind == pb.GetTaskResponse.WAIT:
            time.sleep(reply.retry_after_s or 0.05)
            self.waited = True
            return None
        self.task = reply.task
        return self.feed_lease(self.task), None  # every report is delivered above

    def train_lease(self, fed, before: int | None) -> None:
        """The lease's minibatches, a call at a time, with the next lease asked for ahead meanwhile."""
        t = self.task
        bounds = minibatches(t, self.records_per_push)  # never empty: the ledger cuts no empty task
        if self.waited:
            self.trainer.refresh_dense()
            self.waited = False
        self.leaving = threading.Event()
        self.ahead = self.prefetch.submit(self.lease_ahead, t.task_id, self.leaving, before)
        done = 0  # minibatches of the lease computed
        while done < len(bounds):
            if self.reporter.hold:
                self.hold_for_checkpoint()
            if self.reporter.refused or self.stop.is_set():
                break
            # Before the step, not after: its gradient is then taken on values that hold every push of this
            # worker's but the newest pushes_in_flight - 1 (with one, all of them).
            waiting = time.monotonic()
            with phase("train: wait for push and pull"):
                self.settle(keep=self.trainer.pushes_ahead(self.pushes_in_flight))
            self.wait_s += time.monotonic() - waiting
            group = bounds[done : done + self.trainer.minibatches_per_call(len(bounds) - done, len(bounds))]
            done += len(group)
            self.train_call(fed, group)
        self.leaving.set()

    def train_call(self, fed, group: list[tuple[int, int]]) -> None:
        """One call of the lease's minibatches `group`, computed and its push handed over."""
        t = self.task
        (seq, _), (_, hi) = group[0], group[-1]
        at = Records(t.shard, t.shard_index, t.epoch, seq, hi)
        batch = self.trainer.minibatch(fed, seq - t.start, hi - t.start, [lo - t.start for lo, _ in group])
        started = time.monotonic()
        with working_on(at), phase(COMPUTE if self.traced else "train: first compute (traces the step)"):
            result = self.trainer.compute(batch, at)
        took = time.monotonic() - started
        self.step_s += took
        faults.STEP_DONE(took)
        self.traced = True
        key = PushKey(t.task_id, seq, hi, t.epoch, t.shard_index)
        with phase("train: hand the push over, pump reports"):
            handle = self.trainer.push_start(result, key, [lo for lo, _ in group] + [hi])
            self.in_flight.append((handle, t.task_id, group, hi == t.end))
            self.settle(keep=1, done_only=True)  # reported as soon as possible: the lease ahead waits on it
            self.reporter.pump()

    def hold_for_checkpoint(self) -> None:
        """A checkpoint: every push this worker made is applied and reported before it waits, so the shards' state
        and the ledger are cut at the same pushes."""
        with phase("train: checkpoint: settle pushes, flush reports"):
            self.settle()
            self.reporter.flush()
        self.reporter.hold = False
        with phase("train: checkpoint: held while the master cuts it"):
            cut = self.master.hold(self.stop)
        with phase("train: checkpoint: pull the values others pushed"):
            self.trainer.refresh_dense(unless_at=cut)  # others may have pushed after our last push

    def settle(self, keep: int = 0, done_only: bool = False) -> None:
        """Collect the oldest pushes until at most `keep` are in flight (`done_only`: those done, without waiting);
        report them in order, each minibatch on its own (the master counts duplicates one by one; consecutive
        others are coalesced)."""
        in_flight = self.in_flight
        while len(in_flight) > keep and not (done_only and not in_flight[0][0].done()):
            handle, task_id, group, last = in_flight.popleft()
            for (seq, hi), (applied, loss) in zip(group, self.trainer.push_finish_each(handle)):
                self.reporter.report(
                    task_id, hi, hi - seq, loss, duplicate=not applied, last=last and hi == group[-1][1]
                )

    def feed_lease(self, task):
        with working_on(Records(task.shard, task.shard_index, task.epoch, task.start, task.end)):
            with phase("lease: read"):
                rows = self.readers.read(task.shard, task.start, task.end)
            with phase("lease: feed()"):
                return self.trainer.feed_lease(rows)

    def lease_ahead(self, after: int, leaving: threading.Event, before: int | None):
        """(task, its fed rows) to start after task `after`, or None once the worker leaves that task with nothing
        leased ahead. `before`: the task the worker trained before `after`, whose last report may still be on its
        way; the master hands out no lease ahead until it has it, so the request waits for its answer rather than
        polling (a small model's lease lasts a few milliseconds). On the lease-ahead thread."""
        if before is not None:
            with phase("lease: wait for the last report of the lease before"):
                self.reporter.wait_finished(before, leaving)
        retry = AHEAD_RETRY_S
        while True:
            with phase("lease: GetTask ahead"):
                reply = self.master.get_task(ahead_of=after)
            if reply.kind == pb.GetTaskResponse.TASK:
                return reply.task, self.feed_lease(reply.task)
            if reply.kind == pb.GetTaskResponse.DONE or leaving.wait(retry):
                return None
            retry = min(2 * retry, AHEAD_RETRY_MAX_S)

    def drop_everything(self) -> None:
        """The shards moved: the pushes in flight may or may not have landed before the restore that erased them,
        and the master rewound its ledger to the same cut, so nothing in hand counts."""
        self.leaving.set()
        while self.in_flight:
            with contextlib.suppress(Exception):
                self.trainer.push_finish_each(self.in_flight.popleft()[0])
        if self.ahead is not None:
            with contextlib.suppress(Exception):
                self.ahead.result()
        self.reporter.drop()

    def finish(self) -> None:
        """SIGTERM or DONE: finish the minibatches in hand, deliver every report, then exit. A lease taken ahead and
        never started goes back to the queue when the master sees us exit."""
        self.leaving.set()
        try:
            with contextlib.suppress(ShardsMoved):  # nothing to deliver to: the master rewinds past it
                self.settle()
            self.reporter.flush()
        finally:
            self.reporter.close()
            self.prefetch.shutdown(wait=True, cancel_futures=True)
