"""Membership: which instances exist and what state each is in, from backend events and RPCs.

Counts what the summary reports (started, lost, relaunched, max alive) and keeps the timeline.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from elastic_step.backends.api import EventKind, InstanceEvent, InstanceId


@dataclasses.dataclass
class Member:
    id: InstanceId
    state: str = "pending"  # pending (queued: held by the platform past its bound) -> running -> registered -> gone
    address: str = ""
    last_seen: float = 0.0
    launches: int = 1
    progress_since_launch: bool = False
    crashes_without_progress: int = 0  # consecutive launches that crashed before committing


class Membership:
    def __init__(self) -> None:
        self.members: dict[InstanceId, Member] = {}
        self.started = 0
        self.lost = 0
        self.lost_by_cause: collections.Counter[str] = collections.Counter()  # master/relaunch.py loss_cause
        self.relaunched = 0
        self.max_alive = 0
        self.alive_samples: list[tuple[float, int]] = []
        self._training: set[InstanceId] = set()  # workers registered: kept as states change, counted at each
        self._workers: collections.Counter[str] = collections.Counter()  # workers by state, kept as states change
        self.devices: dict[tuple[str, int], str] = {}  # (worker, launch) -> the device it said it trains on

    def _member(self, inst: InstanceId) -> Member:
        m = self.members.get(inst)
        if m is None:
            m = self.members[inst] = Member(inst)
            if inst.role == "worker":
                self._workers[m.state] += 1
        return m

    def _set_state(self, m: Member, state: str) -> None:
        if m.id.role == "worker":
            self._workers[m.state] -= 1
            self._workers[state] += 1
            (self._training.add if state == "registered" else self._training.discard)(m.id)
        m.state = state

    def launched(self, inst: InstanceId, relaunch: bool) -> None:
        if inst not in self.members:
            self._member(inst)
        else:
            m = self.members[inst]
            self._set_state(m, "pending")
            m.launches, m.progress_since_launch = m.launches + 1, False
        if inst.role == "worker":
            self.started += 1
            self.relaunched += int(relaunch)

    def on_event(self, ev: InstanceEvent) -> None:
        m = self._member(ev.instance)
        if ev.kind == EventKind.RUNNING and m.state in ("pending", "queued"):
            self._set_state(m, "running")
        elif ev.kind == EventKind.WAITING and m.state == "pending":
            self._set_state(m, "queued")
        elif ev.kind in (EventKind.EXITED, EventKind.LOST):
            self._set_state(m, "gone")
            crashed = ev.kind == EventKind.EXITED and ev.exit_code not in (0, None)
            m.crashes_without_progress = (
                m.crashes_without_progress + 1 if crashed and not m.progress_since_launch else 0
            )
        self._sample(ev.time)

    def declared_gone(self, inst: InstanceId, t: float) -> None:
        """The master gave the instance up before its backend said it ended (declared hung): it trains no
        more. Its end, when the backend reports it, is counted then."""
        m = self.members.get(inst)
        if m is not None and m.state != "gone":
            self._set_state(m, "gone")
            self._sample(t)

    def registered(self, inst: InstanceId, address: str = "", device: str = "") -> bool:
        """True when this is the launch's first registration (or at a new address). `device`: what a worker trains
        on, kept per launch."""
        m = self._member(inst)
        if inst.role == "worker" and device:
            self.devices.setdefault((str(inst), m.launches), device)
        new = m.state != "registered" or m.address != address
        self._set_state(m, "registered")
        m.address, m.last_seen = address, time.time()
        if new:
            self._sample(m.last_seen)
        return new

    def seen(self, inst: InstanceId, progressed: bool = False) -> None:
        m = self.members.get(inst)
        if m is not None:
            m.last_seen = time.time()
            m.progress_since_launch |= progressed

    def alive(self, role: str = "worker") -> list[InstanceId]:
        return sorted(i for i, m in self.members.items() if i.role == role and m.state != "gone")

    def training(self, role: str = "worker") -> list[InstanceId]:
        return sorted(i for i, m in self.members.items() if i.role == role and m.state == "registered")

    def lost_one(self, cause: str) -> None:
        """A worker's end that the relaunch policy acts on, by its cause."""
        self.lost += 1
        self.lost_by_cause[cause] += 1

    def worker_states(self) -> collections.Counter[str]:
        """How many workers are in each state (pending, queued, running, registered, gone), without listing them."""
        return collections.Counter(self._workers)

    def training_count(self) -> int:
        """len(training()), without listing them: registrations of thousands of workers each take a sample."""
        return len(self._training)

    def _sample(self, t: float) -> None:
        n = len(self._training)
        self.max_alive = max(self.max_alive, n)
        self.alive_samples.append((t, n))

    def summary(self) -> dict:
        return {
            "started": self.started,
            "lost": self.lost,
            "lost_by_cause": dict(sorted(self.lost_by_cause.items())),
            "relaunched": self.relaunched,
            "max_alive": self.max_alive,
            # each worker launch's device, in the order they registered
            "devices": [{"instance": i, "launch": n, "device": d} for (i, n), d in self.devices.items()],
        }
