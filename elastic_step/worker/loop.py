"""The worker's task loop: lease, read, compute, push, report — pipelined.

The push of minibatch t travels while minibatch t+1 is read and its gradients computed (async
SGD tolerates that one step of staleness), and watermarks go to the master from a background
thread in order. Neither weakens exactly-once: a pushed-but-unreported minibatch is re-pushed
under the same (task, seq) key by whoever takes the remainder, and the PS skips it.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
import time

from elastic_step.instance import MasterClient
from elastic_step.proto import elastic_pb2 as pb

log = logging.getLogger("elastic_step.worker")


class Reporter:
    """Sends progress reports in order from a thread; `flush()` waits until all are delivered."""

    def __init__(self, master: MasterClient):
        self.master = master
        self._queue: queue.Queue = queue.Queue()
        self.refused = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="reporter", daemon=True)
        self._thread.start()

    def report(self, task_id: int, watermark: int, records: int, loss: float, duplicate: bool) -> None:
        self._queue.put((task_id, watermark, records, loss, duplicate))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if not self.refused.is_set() and not self.master.report(*item):
                    self.refused.set()
            except BaseException as e:  # noqa: BLE001 - surfaced by flush()
                self.error = e
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        self._queue.join()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)


# Pushes in flight per worker. Two lets the worker's compute and the PS's update overlap fully
# (throughput bound by the slower of the two, not by their sum plus a round trip), at the cost
# of at most two steps of staleness, which async SGD tolerates.
PUSH_DEPTH = 2


def train_tasks(master: MasterClient, trainer, readers, minibatch_size: int, stop: threading.Event) -> str:
    """Train until the master says DONE or `stop` is set. Returns why it ended."""
    reporter = Reporter(master)
    pusher = concurrent.futures.ThreadPoolExecutor(max_workers=PUSH_DEPTH, thread_name_prefix="push")
    in_flight: collections.deque = collections.deque()   # (future, task_id, hi, records, loss), in order

    def settle(keep: int = 0) -> None:
        """Wait for the oldest pushes until at most `keep` are in flight; report them in order."""
        while len(in_flight) > keep:
            future, task_id, hi, records, loss = in_flight.popleft()
            applied = future.result()
            reporter.report(task_id, hi, records, loss, duplicate=not applied)

    try:
        while not stop.is_set():
            # The master hands a worker its current lease again until the lease's last report
            # arrives, so deliver every report before asking for more work.
            settle()
            reporter.flush()
            reply = master.get_task()
            if reply.kind == pb.GetTaskResponse.DONE:
                return "done"
            if reply.kind == pb.GetTaskResponse.WAIT:
                time.sleep(reply.retry_after_s or 0.05)
                continue
            t = reply.task
            # Minibatch boundaries are fixed by the task's own start, so a remainder leased after a
            # loss pushes the same (task, seq) keys the lost worker did.
            seq = t.start
            while seq < t.end and not reporter.refused.is_set():
                hi = min(t.end, t.task_start + ((seq - t.task_start) // minibatch_size + 1) * minibatch_size)
                grads = trainer.compute(readers.read(t.shard, seq, hi))
                settle(keep=PUSH_DEPTH - 1)
                in_flight.append((pusher.submit(trainer.push, grads, t.task_id, seq), t.task_id, hi, hi - seq,
                                  grads.loss))
                seq = hi
                if stop.is_set():
                    break
            if reporter.refused.is_set():
                # The master no longer counts this lease ours (it thought us lost): start afresh.
                settle()
                reporter.flush()
                log.warning("master refused progress on task %d: dropping the lease", t.task_id)
                reporter.refused.clear()
        return "stopped"
    finally:
        # SIGTERM or DONE: finish the minibatch in hand, deliver every report, then exit.
        try:
            settle()
            reporter.flush()
        finally:
            reporter.close()
            pusher.shutdown(wait=True)
