"""Gray failures: what the master does with an instance the backend still reports alive, but that fails the job all
the same. A worker that holds work and commits nothing (hang.py), a ring member that holds every step to its pace
(ring_straggler.py) and a PS shard that does not answer (ps_watch.py) are given up: fenced first (fence.py), so
that nothing they send after their work is requeued is applied, then stopped through the backend. Their end, when
the backend reports it, is a loss, whatever their exit code said, and the relaunch policy replaces them (a PS:
restores every shard from the last checkpoint).

The job's pump calls `tick` every turn and passes every backend event through `on_end` before it acts on it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Protocol

from elastic_step.backends.api import Backend, EventKind, InstanceEvent, InstanceId
from elastic_step.fault_hooks import JobFaults
from elastic_step.instance.api import EXIT_FENCED
from elastic_step.master.gray.hang import HangBounds, Hung
from elastic_step.master.gray.ps_watch import PSWatch
from elastic_step.master.gray.ring_straggler import Straggler
from elastic_step.master.timeline import Timeline

log = logging.getLogger("elastic_step.master")

FENCE_DEADLINE_S = 2.0  # the most the pump waits for the PS shards to hear that a worker launch is fenced


class Decisions(Protocol):
    """What the policy asks of the job's coordinator (master/leases/coordinator.py), which decides under its
    lock who is past its bound and what becomes of its lease; the PS watch reads the shards' addresses."""

    lock: threading.Lock
    ps_ready: threading.Event
    ps_addresses: list[str]
    rewinding: bool
    timeline: Timeline  # where the policy's own decisions are recorded

    def hung_workers(self, now: float, paused: bool = False) -> list[Hung]: ...
    def declare_hung(self, hung: Hung, now: float) -> tuple[int, int] | None: ...
    def ring_straggler(self, paused: bool = False) -> Straggler | None: ...
    def declare_straggler(self, straggler: Straggler, now: float) -> tuple[int, int] | None: ...
    def fence(self, inst: InstanceId, why: str) -> int: ...


class GrayFailures:
    def __init__(
        self,
        coord: Decisions,
        backend: Backend,
        faults: JobFaults,
        *,
        retire: Callable[[InstanceId, str], None],
        token: str,
        allreduce: bool,
        bounds: HangBounds,
    ):
        """`retire(inst, why)`: `inst` is left out for good, its end is not relaunched (the relaunch policy's)."""
        self.coord, self.backend, self.faults, self.retire = coord, backend, faults, retire
        self.token, self.allreduce = token, allreduce
        # ps: a shard that does not answer is declared hung and handled as a lost one.
        self.ps_watch = None if allreduce else PSWatch(coord, token, bounds)
        self._hung: set[InstanceId] = set()  # declared hung, stopped, their end not seen yet
        self._left_out: set[InstanceId] = set()  # allreduce stragglers left out of the ring, their end not seen yet
        self._kill_at: dict[InstanceId, float] = {}  # declared hung, their kill deferred (faults only) until then

    def start(self) -> None:
        if self.ps_watch is not None:
            self.ps_watch.start()

    def close(self) -> None:
        if self.ps_watch is not None:
            self.ps_watch.close()

    def tick(self, now: float, evaluating: bool) -> None:
        """Give up whoever is past its bound. `evaluating`: an epoch's evaluation holds every worker."""
        ps_silent = self.ps_watch is not None and self.ps_watch.silent(now)  # a push waits on it: not the worker's
        for hung in self.coord.hung_workers(now, paused=evaluating or ps_silent):
            inst = InstanceId.parse(hung.worker)
            self._hung.add(inst)
            # First: nothing it sends after its lease is requeued is applied, should it outlive its kill.
            self.fence(inst, f"declared hung: {hung}", tell_shards=True)
            # Faults only (a zombie): the kill waits for the instance to end by itself (it is fenced) or the limit.
            if (wait_s := self.faults.kill_deferred(inst, self.backend)) > 0:
                self._kill_at[inst] = now + wait_s
                log.warning("%s: its kill waits up to %.0f s for it to end by itself (a fault: a zombie)", inst, wait_s)
            else:
                self.backend.kill(inst)
            self.coord.declare_hung(hung, now)
        # allreduce: a member that holds every step to its pace leaves the ring as a hung one does.
        if self.allreduce and (straggler := self.coord.ring_straggler(paused=evaluating)) is not None:
            inst = InstanceId.parse(straggler.worker)
            self._left_out.add(inst)
            self.fence(inst, f"left out of the ring as a straggler: {straggler}", tell_shards=False)
            if straggler.again:
                self.retire(inst, f"left out of the ring for good as a straggler: {straggler}")
            self.backend.kill(inst)
            self.coord.declare_straggler(straggler, now)
        # A shard that does not answer: killed, and its end is a lost PS (a restore from the last checkpoint). A
        # checkpoint's Save holds the pump itself, and the tick after it counts at most MAX_TICK_S of it.
        for hung in self.ps_watch.hung(now) if self.ps_watch is not None else ():
            inst = InstanceId.parse(hung.worker)
            self._hung.add(inst)
            self.backend.kill(inst)
            self.ps_watch.declare_hung(hung, now)
        for inst, at in list(self._kill_at.items()):
            if now >= at:
                del self._kill_at[inst]
                log.warning("%s: declared hung, fenced, and still running when its deferred kill came: killed", inst)
                self.backend.kill(inst)

    def given_up(self) -> tuple[int, int]:
        """(workers declared hung, ring stragglers left out): given up, their end not reported yet. From any thread: the
        set is copied at once (the pump changes it), then counted."""
        return sum(1 for i in tuple(self._hung) if i.role == "worker"), len(self._left_out)

    def fence(self, inst: InstanceId, why: str, tell_shards: bool) -> None:
        """Give `inst`'s launch up: the master refuses its calls from now on and, with `tell_shards`, the PS shards
        its pushes (a short deadline: a shard that does not answer is stopped as a frozen PS, not waited for)."""
        launch = self.coord.fence(inst, why)
        if not launch or not tell_shards or self.allreduce or not self.coord.ps_ready.is_set():
            return
        from elastic_step.ps.client import PSClient

        ps = PSClient(list(self.coord.ps_addresses), self.token)
        try:
            failed = ps.fence(inst.index, launch, timeout=FENCE_DEADLINE_S)
        finally:
            ps.close()
        if failed:
            log.warning("%s launch %d: not every PS shard was told it is fenced: %s", inst, launch, "; ".join(failed))
            self.coord.timeline.record("fence_unsent", str(inst), "; ".join(failed), launch=launch)

    def on_end(self, ev: InstanceEvent) -> InstanceEvent:
        """A backend event as the master takes it: a worker's loss is fenced (it may still run: a pod deleted on a
        partitioned node); the end of one given up is the loss it was given up for."""
        ended = ev.kind in (EventKind.EXITED, EventKind.LOST)
        if ev.instance.role == "worker" and (
            ev.kind == EventKind.LOST or (ev.kind == EventKind.EXITED and ev.exit_code not in (0, None))
        ):
            # Its lease is requeued next. The shards hear of one lost; one that exited sends nothing more.
            why = ev.detail or f"{ev.kind.value}, exit code {ev.exit_code}"
            self.fence(ev.instance, why, tell_shards=ev.kind == EventKind.LOST)
        if not ended:
            return ev
        self._kill_at.pop(ev.instance, None)
        how = ev.detail or f"exit code {ev.exit_code}"
        if ev.instance in self._hung:
            self._hung.discard(ev.instance)
            return dataclasses.replace(ev, kind=EventKind.LOST, detail=f"declared hung, then {how}")
        if ev.instance in self._left_out:
            self._left_out.discard(ev.instance)
            return dataclasses.replace(ev, kind=EventKind.LOST, detail=f"left out as a straggler, then {how}")
        if ev.kind == EventKind.EXITED and ev.exit_code == EXIT_FENCED:
            # Refused as a launch the master had given up: the loss it was given up for, never a crash.
            return dataclasses.replace(ev, kind=EventKind.LOST, detail=f"fenced, then exit code {EXIT_FENCED}")
        return ev
