"""`GET /metrics`: the step's metrics in Prometheus' text format, from a registry of its own (never the process's
global one: two jobs in one process, tests among them, keep theirs apart).

Nothing is counted per record. What the master already keeps (the ledger, the membership, the checkpoints, the
goodput) is read by a collector when Prometheus scrapes, under the coordinator's lock for a moment; only the
master's RPC latencies, its refusals and the workers' waits for a lease are observed as they happen, one
histogram sample a call. Every series carries the job's id as `job_id`'s value in the label `job`, and no label
takes a per-record or per-worker value. The reference of every name: docs/observability.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from elastic_step.master.observe.goodput import CAUSES, Goodput
from elastic_step.master.relaunch import LOSS_CAUSES

PREFIX = "elastic_step_"
WORKER_STATES = ("pending", "queued", "training", "lost", "fenced", "hung", "straggling")
RPC_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LEASE_WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class ServedCalls:
    """What the master's service observes as it serves (master/service.py calls these; no import back up)."""

    def __init__(self, registry: CollectorRegistry, job_id: str):
        self._latency = Histogram(
            PREFIX + "master_rpc_duration_seconds",
            "Time the master took to serve a call of an instance's, by call",
            ["job", "call"],
            registry=registry,
            buckets=RPC_BUCKETS_S,
        )
        self._errors = Counter(
            PREFIX + "master_rpc_errors",
            "Calls the master refused, by call and gRPC status code (a wrong token, a fenced launch, bad input)",
            ["job", "call", "code"],
            registry=registry,
        )
        self._lease_wait = Histogram(
            PREFIX + "lease_wait_seconds",
            "Time a worker asked for work before it was given a lease",
            ["job"],
            registry=registry,
            buckets=LEASE_WAIT_BUCKETS_S,
        ).labels(job_id)
        self._job_id = job_id
        self._by_call: dict[str, object] = {}

    def served(self, call: str, seconds: float) -> None:
        h = self._by_call.get(call)
        if h is None:
            h = self._by_call[call] = self._latency.labels(self._job_id, call)
        h.observe(seconds)

    def refused(self, call: str, code: str) -> None:
        self._errors.labels(self._job_id, call, code).inc()

    def lease_waited(self, seconds: float) -> None:
        self._lease_wait.observe(seconds)


@dataclasses.dataclass
class JobState:
    """The master's parts the collector reads (the job builds it; the collector holds no job)."""

    job_id: str
    coord: object  # master/leases/coordinator.py Coordinator
    goodput: Goodput
    hung: Callable[[], int]  # workers declared hung, their end not seen yet (master/gray/policy.py)
    left_out: Callable[[], int]  # allreduce stragglers left out, their end not seen yet
    relaunches: Callable[[], int]
    checkpoints: Callable[[], dict]  # master/durability/checkpoint.py JobCheckpoints.summary
    evaluation: Callable[[], dict]  # the last point of the eval curve (or the final evaluation)


@dataclasses.dataclass(frozen=True)
class _Figures:
    """What a scrape reads of the coordinator, in one moment under its lock."""

    committed: int
    epoch: int
    epochs: int
    per_epoch: int
    this_epoch: int  # records of the current epoch committed
    requeued: int
    trained_again: int
    throughput: float
    states: dict[str, int]  # the membership's workers by state
    fenced: int
    lost_by_cause: dict[str, int]
    step_s: float
    wait_s: float
    waits_on: str  # what the workers wait on: "ps" or "ring"
    shard_pushes: list[int]  # applied, skipped
    pushes_skipped: int
    goodput: dict

    @classmethod
    def read(cls, coord, goodput: Goodput) -> _Figures:
        with coord.lock:
            ledger, membership = coord.ledger, coord.membership
            committed, trained_again = ledger.records_committed_total(), ledger.trained_again
            account = ledger.accounts[-1] if ledger.accounts else None
            fenced = sum(
                1
                for worker, f in coord.fences.fenced.items()
                if (m := membership.members.get(_parse(worker))) is not None
                and f.launch >= m.launches
                and m.state != "gone"
            )
            step_s, wait_s = coord.pace.spent_total()
            return cls(
                committed=committed,
                epoch=max(0, min(ledger.epoch, ledger.epochs - 1)),
                epochs=ledger.epochs,
                per_epoch=ledger.records_per_epoch,
                this_epoch=account.committed if account else 0,
                requeued=sum(a.requeued for a in ledger.accounts),
                trained_again=trained_again,
                throughput=coord.throughput(),
                states=membership.worker_states(),
                fenced=fenced,
                lost_by_cause=dict(membership.lost_by_cause),
                step_s=step_s,
                wait_s=wait_s,
                waits_on="ring" if coord.rendezvous is not None else "ps",
                shard_pushes=[sum(p[i] for p in coord.pace.shard_pushes.values()) for i in (0, 1)],
                pushes_skipped=coord.duplicates_suppressed,
                goodput=goodput.figures(committed, trained_again),
            )


class JobCollector(Collector):
    """Every figure the master keeps anyway, read when scraped."""

    def __init__(self, state: JobState):
        self.state = state

    def collect(self) -> Iterator[Metric]:
        s, job = self.state, [self.state.job_id]
        f = _Figures.read(s.coord, s.goodput)
        yield from _records(job, f)
        yield from _workers(s, f)
        yield from _checkpoints(job, s.checkpoints())
        evaluation = GaugeMetricFamily(
            PREFIX + "eval_metric", "The last evaluation's metrics, by name", labels=["job", "metric"]
        )
        for name, value in s.evaluation().items():
            if isinstance(value, (int, float)) and name != "epoch":
                evaluation.add_metric([s.job_id, name], float(value))
        yield evaluation
        yield from _goodput(job, f.goodput)


def _records(job: list[str], f: _Figures) -> Iterator[Metric]:
    yield _counter("records_committed", "Records committed once (every epoch)", job, f.committed)
    yield _gauge("epoch", "The epoch being trained (from 0)", job, f.epoch)
    yield _gauge("epochs", "The epochs the step trains", job, f.epochs)
    yield _gauge("epoch_records", "Records an epoch holds", job, f.per_epoch)
    yield _gauge("epoch_records_committed", "Records of the current epoch committed", job, f.this_epoch)
    yield _counter("records_requeued", "Records put back in the queue by a worker's loss", job, f.requeued)
    yield _counter(
        "records_trained_again",
        "Records committed, then trained again after a rewind to a checkpoint",
        job,
        f.trained_again,
    )
    yield _gauge("records_per_second", "Records committed a second, in the steady state", job, f.throughput)


def _workers(s: JobState, f: _Figures) -> Iterator[Metric]:
    job = [s.job_id]
    workers = GaugeMetricFamily(PREFIX + "workers", "Workers by state", labels=["job", "state"])
    counts = {
        "pending": f.states["pending"] + f.states["running"],  # launched, not registered yet
        "queued": f.states["queued"],  # held by the platform (Kueue, the scheduler) past its bound
        "training": f.states["registered"],
        "lost": f.states["gone"],
        "fenced": f.fenced,
        "hung": s.hung(),
        "straggling": s.left_out(),  # allreduce: left out of the ring (ps: a handover is an event, not a state)
    }
    for state in WORKER_STATES:
        workers.add_metric([s.job_id, state], counts[state])
    yield workers
    losses = CounterMetricFamily(PREFIX + "worker_losses", "Workers lost, by cause", labels=["job", "cause"])
    for cause in LOSS_CAUSES:
        losses.add_metric([s.job_id, cause], f.lost_by_cause.get(cause, 0))
    yield losses
    yield _counter("worker_relaunches", "Instances relaunched after a loss", job, s.relaunches())
    # What only the workers know, as their reports carry it (ps: ReportProgress; allreduce: StepReady)
    yield _counter("worker_step_seconds", "The workers' time computing their steps", job, f.step_s)
    waited = CounterMetricFamily(
        PREFIX + "worker_wait_seconds",
        "The workers' time waiting on the PS shards (ps) or in the ring's collectives (allreduce)",
        labels=["job", "on"],
    )
    waited.add_metric([s.job_id, f.waits_on], f.wait_s)
    yield waited
    pushes = GaugeMetricFamily(
        PREFIX + "ps_pushes",
        "Pushes the PS shards hold as applied, and skipped as already applied, as their heartbeats say",
        labels=["job", "result"],
    )
    for result, n in zip(("applied", "skipped"), f.shard_pushes):
        pushes.add_metric([s.job_id, result], n)
    yield pushes
    yield _counter(
        "pushes_skipped",
        "Pushes every PS shard had already applied (a lost worker's, pushed again)",
        job,
        f.pushes_skipped,
    )


def _goodput(job: list[str], goodput: dict) -> Iterator[Metric]:
    yield _gauge(
        "goodput_ratio", "Share of the step's wall time that produced records committed once", job, goodput["ratio"]
    )
    yield _gauge(
        "worker_goodput_ratio",
        "Share of the workers' seconds that produced records committed once",
        job,
        goodput["worker_ratio"],
    )
    for unit, key, what in (("seconds", "wall_s", "wall time"), ("worker_seconds", "worker_s", "worker-seconds")):
        spent = CounterMetricFamily(
            f"{PREFIX}goodput_{unit}",
            f"The step's {what}, by what it went to (training or a cause of loss)",
            labels=["job", "cause"],
        )
        for cause in ("training", *CAUSES):
            spent.add_metric(job + [cause], goodput[key][cause])
        yield spent


def _checkpoints(job: list[str], summary: dict) -> Iterator[Metric]:
    written = summary.get("checkpoints", [])
    yield _counter("checkpoints", "Checkpoints written", job, summary.get("written", 0))
    yield _counter("checkpoints_abandoned", "Checkpoints begun and abandoned", job, summary.get("abandoned", 0))
    last = written[-1] if written else {}
    yield _gauge("checkpoint_write_seconds", "The last checkpoint's write", job, last.get("write_s", 0.0))
    yield _gauge(
        "checkpoint_hold_seconds",
        "The last checkpoint's hold on the workers (barrier and cut)",
        job,
        last.get("hold_s", 0.0) + last.get("held_s", 0.0),
    )
    yield _gauge("checkpoint_bytes", "The last checkpoint's size in the store", job, last.get("bytes", 0))
    yield _counter(
        "ps_restores",
        "Times every PS shard was restored from a checkpoint after a loss",
        job,
        len(summary.get("ps_restores", [])),
    )
    yield _counter("restarts", "Times the step resumed from a checkpoint", job, len(summary.get("restarts", [])))


def _parse(worker: str):
    from elastic_step.backends.api import InstanceId

    return InstanceId.parse(worker)


def _counter(name: str, doc: str, job: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, doc, labels=["job"])
    family.add_metric(job, value)
    return family


def _gauge(name: str, doc: str, job: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, doc, labels=["job"])
    family.add_metric(job, value)
    return family


class JobMetrics:
    """A step's registry, served from the step's start (master/health.py); its job registers in it once it knows
    its id (`watch`)."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)

    def watch(self, state: JobState) -> ServedCalls:
        """Collect `state` from now on; returns what the job's service observes as it serves."""
        self.registry.register(JobCollector(state))
        return ServedCalls(self.registry, state.job_id)

    def render(self) -> tuple[bytes, str]:
        """The text a scrape gets, and its content type."""
        # The text format every Prometheus 2 and 3 reads (names are plain ASCII: no escaping needed).
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
