"""Backend contract: start and stop *instances* (role, index) and stream their lifecycle events.

The master never knows whether an instance is a subprocess or a pod. Implementations:
`local.LocalBackend` (subprocesses; the embedded default) and `kubernetes.KubernetesBackend`.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import queue
import time
from collections.abc import Iterator

from elastic_step.errors import ConfigError

ROLES = ("worker", "ps")


@dataclasses.dataclass(frozen=True, order=True)
class InstanceId:
    role: str
    index: int

    def __post_init__(self):
        if self.role not in ROLES:
            raise ConfigError(f"Unknown instance role {self.role!r}; expected one of {ROLES}.")
        if self.index < 0:
            raise ConfigError(f"Instance index must be >= 0, got {self.index}.")

    def __str__(self) -> str:
        return f"{self.role}-{self.index}"

    @classmethod
    def parse(cls, name: str) -> InstanceId:
        """The instance a name such as "worker-3" (its str) names."""
        role, index = name.rsplit("-", 1)
        return cls(role, int(index))


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    """What to run: the same command line whatever the backend."""

    id: InstanceId
    argv: list[str]  # e.g. [python, -m, elastic_step.worker, ...]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    cpu: str | None = None  # Kubernetes quantities, e.g. "1", "500m"
    memory: str | None = None
    priority_class: str | None = None


class EventKind(str, enum.Enum):
    STARTED = "started"  # accepted by the backend (a pod may still be Pending)
    RUNNING = "running"  # the process runs
    EXITED = "exited"  # ended by itself; exit_code says how
    LOST = "lost"  # killed, preempted or deleted from outside
    WAITING = "waiting"  # still not running past the job's bound (pending_report); detail: what holds it


@dataclasses.dataclass(frozen=True)
class InstanceEvent:
    kind: EventKind
    instance: InstanceId
    exit_code: int | None = None
    detail: str = ""
    time: float = dataclasses.field(default_factory=time.time)


class BackendError(Exception):
    """The backend could not start or stop an instance (e.g. a missing permission)."""


class Backend(abc.ABC):
    """Starts/stops instances and reports what happens to them, as soon as it happens."""

    name = ""  # what --backend calls it
    # Whether instances open the master's local files at their paths (processes of one machine);
    # if not (pods), the master serves the ones they need (master/input_server.py).
    shares_files = True

    def __init__(self) -> None:
        self._events: queue.Queue[InstanceEvent] = queue.Queue()

    def emit(self, event: InstanceEvent) -> None:
        self._events.put(event)

    def events(self, timeout: float) -> Iterator[InstanceEvent]:
        """Yield the events that arrive within `timeout` seconds (at least waiting for one)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                yield self._events.get(timeout=max(0.0, remaining))
            except queue.Empty:
                return
            if remaining <= 0:
                return

    @abc.abstractmethod
    def start(self, spec: InstanceSpec) -> None:
        """Start the instance; emits STARTED, then RUNNING, then EXITED or LOST."""

    @abc.abstractmethod
    def stop(self, instance: InstanceId, grace_s: float = 10.0) -> None:
        """Ask the instance to stop (SIGTERM), then kill it after `grace_s`."""

    @abc.abstractmethod
    def kill(self, instance: InstanceId) -> None:
        """Kill at once (SIGKILL / delete with grace 0). Used by tests and chaos."""

    can_freeze = False  # whether `freeze` can reach the instance's processes

    def freeze(self, instance: InstanceId) -> None:
        """Freeze the instance where it stands (SIGSTOP), as a hang would: chaos only (faults/chaos.py `stop:`)."""
        raise ConfigError(self.cannot_freeze())

    def cannot_freeze(self) -> str:
        return (
            f"--chaos stop: the {self.name} backend cannot freeze an instance: the master starts and deletes "
            "its instances but cannot reach into their processes to stop them. Use --backend local, or freeze "
            "the instance from outside (its node; the Kubernetes tests freeze a pod through their process kubelet)."
        )

    def thaw(self, instance: InstanceId) -> None:
        """Resume an instance `freeze` froze (SIGCONT): chaos only (faults/chaos.py `stop:...:resume`, a zombie)."""
        raise ConfigError(f"--chaos stop: the {self.name} backend cannot resume an instance; use --backend local.")

    def tell(self, reason: str, note: str, action: str, warning: bool = False) -> None:  # noqa: B027 - no-op by default
        """Tell the platform what the master saw and did (`reason`: CamelCase, e.g. WorkerLost; `action`: what the
        master did, e.g. Relaunch): on Kubernetes an Event on the step's pod (kubernetes/events.py). Nowhere on a
        backend whose platform has no such place (local processes: the step's log says it)."""

    @abc.abstractmethod
    def alive(self) -> set[InstanceId]:
        """Instances started and not yet ended."""

    @abc.abstractmethod
    def master_address(self, port: int) -> str:
        """The address at which instances reach a master listening on `port`."""

    def close(self, grace_s: float = 10.0) -> None:
        """Stop every instance this backend started (the master's SIGTERM path)."""
        for inst in sorted(self.alive()):
            self.stop(inst, grace_s)
