"""A frozen parameter server: one that does not answer is declared hung, and then handled as a lost one.

A PS that is frozen, deadlocked or cut off keeps its process and its port: the backend never says it is gone, and
the workers' pushes to it only wait. So the master asks every shard, from a thread of its own, PROBE_EVERY_S, for
its counters (Stats, brief: no lock, nothing a push holds), with a deadline of PROBE_DEADLINE_S; the thread never
blocks the pump, which only reads when each shard last answered. Each shard has a hang clock of master/gray/hang.py
(an answer is its commit, the bound is the same: --hang-timeout, else max(FLOOR_S, FACTOR × its slowest recent
time between answers)), which does not run while the shards are restored after a loss; a checkpoint's Save
holds the pump itself, whose next tick counts at most MAX_TICK_S of it. A shard past its bound is killed through
the backend (SIGKILL reaches a stopped process; a pod is deleted), and its end is a lost PS: relaunched, and
every shard and the ledger back to the last checkpoint as a new generation (the job's restore path).

While any shard has not answered for SILENT_S, the workers' own hang clocks stop: a worker whose push waits on a
frozen shard is not the one to blame.

A zombie (a frozen shard that resumes before its kill lands) cannot matter. The workers push to the addresses and
generation the master hands out after the restore, and a push of an older generation is refused by every shard
restored in place; what a zombie applies to itself is never read (the master reads the shards at the addresses
registered since); a report of progress on a lease of before the rewind is refused by the ledger.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from elastic_step.backends.api import InstanceId
from elastic_step.master.gray.hang import HangBounds, HangWatch, Hung
from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import elastic_pb2_grpc as pb_grpc
from elastic_step.proto import rpc

log = logging.getLogger("elastic_step.master")

PROBE_EVERY_S = 1.0
PROBE_DEADLINE_S = 2.0  # a probe unanswered by then is given up; the next one goes out anyway
SILENT_S = 2.5  # a shard unanswered this long holds the workers' hang clocks
ANSWER = "answer"


class PSWatch:
    def __init__(self, coord, token: str, bounds: HangBounds, every_s: float = PROBE_EVERY_S):
        """`coord`: the job's coordinator (the shards' addresses); `bounds`: the job's, the workers' too."""
        self.coord, self.token, self.every_s = coord, token, every_s
        self.hangs = HangWatch(bounds)
        self._lock = threading.Lock()
        self._answered: dict[int, tuple[str, float]] = {}  # shard -> (its address, when it last answered)
        self._seen: dict[int, float] = {}  # shard -> the last answer the pump counted
        self._addresses: dict[int, str] = {}  # shard -> the address its clock is for
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ the probe thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._probe_forever, name="ps-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=PROBE_DEADLINE_S + 1)

    def _probe_forever(self) -> None:
        channels: dict[str, grpc.Channel] = {}
        try:
            while not self._stop.wait(self.every_s):
                self._probe(channels)
        finally:
            for channel in channels.values():
                channel.close()

    def _probe(self, channels: dict[str, grpc.Channel]) -> None:
        """Ask every shard once, all at once; note who answered, and when."""
        with self.coord.lock:
            addresses = list(self.coord.ps_addresses)
        for gone in set(channels) - set(addresses):  # a lost shard's old address
            channels.pop(gone).close()
        futures = []
        for shard, address in enumerate(addresses):
            if not address:
                continue
            if address not in channels:
                channels[address] = rpc.channel(address)
            request = pb.StatsRequest(token=self.token, brief=True)
            future = pb_grpc.ParameterServerStub(channels[address]).Stats.future(request, timeout=PROBE_DEADLINE_S)
            # Noted as it comes (a frozen shard's wait delays no other's answer).
            future.add_done_callback(lambda f, shard=shard, address=address: self._answer(f, shard, address))
            futures.append(future)
        for future in futures:  # the next round goes out once this one is answered or given up
            future.exception()

    def _answer(self, future, shard: int, address: str) -> None:
        if future.exception() is None:  # else frozen (DEADLINE_EXCEEDED), or gone (the backend says so)
            with self._lock:
                self._answered[shard] = (address, time.time())

    # ------------------------------------------------------------ the pump's side
    def silent(self, now: float) -> bool:
        """A shard at its current address has not answered for SILENT_S (once it answered at all): the
        workers' clocks hold."""
        with self.coord.lock:
            addresses = list(self.coord.ps_addresses)
        with self._lock:
            return any(addresses[s] == a and now - t > SILENT_S for s, (a, t) in self._answered.items())

    def hung(self, now: float, paused: bool = False) -> list[Hung]:
        """Advance the shards' clocks; the shards past their bound. No clock runs while `paused`, or while the
        shards are restored after a loss (the coordinator's `rewinding`)."""
        with self.coord.lock:
            addresses, rewinding = list(self.coord.ps_addresses), self.coord.rewinding
        with self._lock:
            answered = dict(self._answered)
        for shard, address in enumerate(addresses):
            if self._addresses.get(shard) != address:  # a new launch (relaunched after a loss): a new clock
                self._addresses[shard] = address
                self.hangs.forget(name(shard))
            at, t = answered.get(shard, ("", 0.0))
            if at == address and t != self._seen.get(shard):  # a new answer from this launch
                self._seen[shard] = t
                self.hangs.committed(name(shard))
        # A shard's clock starts at its first answer; a shard registered and never answering has the
        # start-up bound (master/gray/hang.py).
        running = [] if paused or rewinding else [name(s) for s, a in enumerate(addresses) if a]
        return [Hung(h.worker, h.idle_s, h.bound_s, h.measured, what=ANSWER) for h in self.hangs.tick(now, running)]

    def declare_hung(self, hung: Hung, now: float) -> None:
        """`hung` is being killed: its clock and answers are forgotten (its successor's start over), and the
        decision is on the timeline (summary.json, the report) and in the log, with the figures."""
        shard = InstanceId.parse(hung.worker).index
        with self._lock:
            self._answered.pop(shard, None)
        self.hangs.forget(hung.worker)
        figures = {"idle_s": round(hung.idle_s, 1), "bound_s": round(hung.bound_s, 1)}
        what = "declared hung, killed; it is relaunched and every shard goes back to the last checkpoint"
        with self.coord.lock:
            self.coord.timeline.record("hung", hung.worker, f"{hung}: {what}", t=now, **figures)
        log.warning("%s: %s: %s", hung.worker, hung, what)


def name(shard: int) -> str:
    return str(InstanceId("ps", shard))
