"""A cluster of N nodes under a seeded job mix, by discrete-event simulation: elastic-step against gang-scheduled,
restart-based training and Kueue-style queued gang admission. Pure Python; no TensorFlow.

    .venv/bin/python bench/cluster_sim.py                                  # 10, 100 and 1,000 nodes, 3 seeds
    .venv/bin/python bench/cluster_sim.py --nodes 10 100 --seeds 5 --json /tmp/cluster_sim.json
    .venv/bin/python bench/cluster_sim.py --validate-only                  # bench/gang.py's two jobs alone

The cluster: N nodes of --slots-per-node worker slots (a slot is one accelerator: a worker uses one). Each node is
reclaimed (a spot reclaim) as a Poisson process of mean --reclaim-mtbf-h hours and comes back, as a replacement,
--node-down-s later; every worker on it is lost.

The job mix (seeded): arrivals are a Poisson process whose rate offers --load of the cluster's slots; a job wants
`max` workers (1 to 32, mostly small), its length at `max` workers is log-normal; --high-fraction of the jobs are
high priority. A job's work is in worker-seconds: the time one worker takes to train it; k workers train k**scaling
worker-seconds a second.

The sides, on the same trace:
  * elastic-step: a job runs from 1 worker (`min`) up to `max`; pending workers are placed as kube-scheduler places
    pods, by priority then submission, and a high-priority job's pending workers preempt low-priority workers. A
    lost worker (reclaim or preemption) costs its in-flight minibatch and a pause of its job while the remainder
    is leased again; a new or replacement worker holds its slot without training for a worker's start-up. The
    job's first step waits for its master's start-up.
  * gang: all `max` workers placed at once or none (Coscheduling): any pending job that fits starts, in priority
    then submission order (smaller jobs pass a blocked large one), and a high-priority job evicts whole
    low-priority jobs to fit. A lost worker restarts the whole job as TFJob and Kubeflow Trainer do: back to its
    last checkpoint (the work since is lost), all its slots released, queued again, a start-up once re-placed.
  * kueue: as gang, but admission is strict FIFO by priority then submission against the cluster's quota (Kueue's
    StrictFIFO ClusterQueue): the queue's head blocks the jobs behind it; evictions of lower-priority whole
    workloads as in gang.

Figures per side: utilization (work done, net of work lost, / the slots' seconds while jobs arrive: the steady
state, not the drain of the trace's longest jobs; `utilization_makespan` is bench/gang.py's definition over the
makespan), allocation (slots held / (slots x makespan)), goodput (useful worker-seconds / allocated worker-seconds:
the one definition every side is held to), JCT mean and p95 (arrival to end), makespan, work lost, preemptions and
restarts. Then each
side's ratio against elastic-step per seed: the median and the range over seeds (each seed is another trace).

The costs' defaults come from the project's measurements, each cited by its section of docs/benchmarks.md where
the figures are: see `Costs`. The validation replays bench/gang.py's `two_jobs` scenario (8 slots, two jobs of
5 workers, elastic-all against Coscheduling) and prints the error on each makespan and on their ratio.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import heapq
import json
import math
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench.plot import log_lines

SIDES = ("elastic", "gang", "kueue")
HIGH, LOW = 1, 0


@dataclasses.dataclass(frozen=True)
class Costs:
    """What each side pays, in seconds. The defaults are the project's measurements, in docs/benchmarks.md:"""

    # Submission (or a gang job's restart) to its first step: the master's start-up and the workers' TensorFlow
    # import. #gang-scheduling-against-elastic-workers, gang job A's first step.
    job_start_s: float = 17.0
    # A worker added to a running elastic job, to its first commit. #recovery, kill -> replacement's first commit.
    worker_start_s: float = 4.0
    # An elastic job's pause on a lost worker: its remainder leased again. #recovery, kill -> remainder leased.
    rescale_s: float = 0.013
    # A lost worker's in-flight minibatch, in worker-seconds: bench/gang.py's simulated accelerator, one
    # minibatch a step (--step-ms). #gang-scheduling-against-elastic-workers.
    inflight_s: float = 0.1
    # Throughput at k workers is k**scaling: every job trained at the same rate per worker with 5 and with 8
    # workers. #gang-scheduling-against-elastic-workers.
    scaling: float = 1.0
    # A gang job's checkpoint interval, of training time: the work since is lost on a restart. An assumption
    # (elastic-step's own default is 60 s, #synchronous-training-against-tensorflows-multiworkermirrored; a
    # checkpoint costs it nothing measurable, #durability; a TensorFlow job checkpoints less often).
    ckpt_interval_s: float = 300.0


@dataclasses.dataclass(frozen=True)
class Mix:
    """The job mix and the churn: assumptions, not measurements (docs/benchmarks.md says which)."""

    slots_per_node: int = 8
    jobs_per_node: float = 10.0  # jobs in the trace, per node
    load: float = 1.0  # offered work / the cluster's slot-seconds, over the arrivals: a cluster kept full
    sizes: tuple = ((1, 0.30), (2, 0.20), (4, 0.20), (8, 0.15), (16, 0.10), (32, 0.05))
    median_length_s: float = 1800.0  # at max workers
    length_sigma: float = 1.0  # of log length
    high_fraction: float = 0.2
    reclaim_mtbf_h: float = 12.0  # per node; 0: no reclaims
    node_down_s: float = 120.0


@dataclasses.dataclass
class Job:
    id: int
    arrival: float
    max_workers: int
    work: float  # worker-seconds
    priority: int = LOW
    min_workers: int = 1
    # state
    workers: list = dataclasses.field(default_factory=list)  # [node, ready_at]
    start_at: float = math.inf  # first step of the current (re)start; inf: not started
    paused_until: float = 0.0
    last: float = 0.0
    progress: float = 0.0
    ckpt_progress: float = 0.0
    train_clock: float = 0.0  # training time since the current (re)start, for the checkpoint interval
    trained: float = 0.0  # every worker-second trained, kept or lost
    lost: float = 0.0
    end: float | None = None
    version: int = 0
    restarts: int = 0
    preempted: int = 0
    queued_at: float = 0.0  # gang sides: the order in the queue (submission, kept across restarts)

    def ready(self, now: float) -> int:
        return sum(1 for w in self.workers if w[1] <= now)

    def rate(self, now: float, scaling: float) -> float:
        if now < self.start_at or now < self.paused_until or self.end is not None:
            return 0.0
        k = self.ready(now)
        return k**scaling if k else 0.0


class Cluster:
    """Nodes, slots and the event queue; a side's scheduling policy drives it (`schedule`)."""

    def __init__(self, side: str, nodes: int, costs: Costs, mix: Mix, jobs: list[Job], reclaims):
        if side not in SIDES:
            raise ValueError(f"side {side!r}: one of {', '.join(SIDES)}")
        self.side, self.costs, self.spn, self.node_down_s = side, costs, mix.slots_per_node, mix.node_down_s
        for j in jobs:
            if not 1 <= j.min_workers <= j.max_workers <= nodes * mix.slots_per_node:
                raise ValueError(
                    f"job {j.id} wants {j.min_workers}-{j.max_workers} workers on {nodes * mix.slots_per_node} slots:"
                    " give it 1 <= min <= max <= the cluster's slots"
                )
        slots_per_node = mix.slots_per_node
        self.free = [slots_per_node] * nodes
        self.open = set(range(nodes))  # nodes up with a free slot: kept, not searched, for 1,000 nodes' speed
        self.free_total = nodes * slots_per_node
        self.up = [True] * nodes
        self.on_node: list[dict[int, int]] = [{} for _ in range(nodes)]  # node -> {job id: workers}
        self.jobs = {j.id: j for j in jobs}
        self.events: list = []
        self.seq = 0
        self.now = 0.0
        self.held = 0  # slots held by workers
        self.held_integral = 0.0
        self.capacity_integral = 0.0
        self.live_slots = nodes * slots_per_node
        # the jobs that want workers: elastic, every unfinished job below max; gang sides, the queued jobs
        self.queue: list[tuple] = []
        self.running: set[int] = set()  # gang sides: admitted jobs
        self.holding: set[int] = set()  # jobs holding workers
        self.unfinished = len(jobs)
        for j in jobs:
            self.push(j.arrival, "arrive", j.id)
        self.window_end = max(j.arrival for j in jobs)
        self.window: dict | None = None
        self.push(self.window_end, "window", None)
        for t, node in reclaims:
            self.push(t, "reclaim", node)

    # ------------------------------------------------------------ events
    def push(self, t: float, kind: str, what, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, what, version))

    def run(self) -> None:
        while self.events:
            t, _, kind, what, version = heapq.heappop(self.events)
            if kind in ("reclaim", "back") and not self.unfinished:
                continue  # churn after the last job: outside the makespan
            dt = t - self.now
            self.held_integral += self.held * dt
            self.capacity_integral += self.live_slots * dt
            self.now = t
            if kind == "arrive":
                self.jobs[what].last = t
                self.enqueue(self.jobs[what])
            elif kind == "window":
                self.snapshot()
            elif kind == "tick":
                self.touch(self.jobs[what])
            elif kind == "done":
                j = self.jobs[what]
                if version == j.version and j.end is None:
                    self.finish(j)
            elif kind == "reclaim":
                self.reclaim(what)
            elif kind == "back":
                self.up[what] = True
                self.free[what] = self.spn
                self.free_total += self.spn
                self.open.add(what)
                self.live_slots += self.spn
            self.schedule()

    def snapshot(self) -> None:
        """The figures while jobs still arrive: the steady state, without the drain of the trace's longest jobs."""
        for j in self.jobs.values():
            if j.end is None:
                self.advance(j)
        self.window = {
            "span_s": self.now,
            "net": sum(j.progress for j in self.jobs.values()),
            "held": self.held_integral,
        }

    # ------------------------------------------------------------ a job's progress
    def advance(self, j: Job) -> None:
        """Bring `j` to now at the rate it had since its last event (every change of rate is an event)."""
        dt = self.now - j.last
        r = j.rate(j.last, self.costs.scaling)
        if r > 0 and dt > 0:
            done = r * dt
            c0 = j.train_clock
            j.train_clock += dt
            if self.side != "elastic":
                iv = self.costs.ckpt_interval_s
                boundary = math.floor(j.train_clock / iv) * iv
                if boundary > c0:
                    j.ckpt_progress = j.progress + r * (boundary - c0)
            j.progress += done
            j.trained += done
        j.last = self.now

    def touch(self, j: Job) -> None:
        """After `j` changed: its next rate change and its predicted end."""
        self.advance(j)
        if j.end is not None:
            return
        j.version += 1
        r = j.rate(self.now, self.costs.scaling)
        if r > 0:
            self.push(self.now + (j.work - j.progress) / r, "done", j.id, j.version)
        later = [t for t in (j.start_at, j.paused_until, *(w[1] for w in j.workers)) if self.now < t < math.inf]
        if later:
            self.push(min(later), "tick", j.id)

    def finish(self, j: Job) -> None:
        self.advance(j)
        j.trained += j.work - j.progress  # the float remainder of the last interval
        j.progress = j.work
        j.end = self.now
        self.unfinished -= 1
        self.release(j, len(j.workers))
        self.running.discard(j.id)
        self.dequeue(j)

    # ------------------------------------------------------------ slots
    def place(self, j: Job, k: int, ready_at: float) -> None:
        """Give `j` k free slots, filling the fullest nodes first (fewer nodes a job, as a scheduler packs)."""
        for n in sorted(self.open, key=lambda n: (self.free[n], n)):
            take = min(k, self.free[n])
            self.free[n] -= take
            self.free_total -= take
            if not self.free[n]:
                self.open.discard(n)
            self.on_node[n][j.id] = self.on_node[n].get(j.id, 0) + take
            j.workers.extend([n, ready_at] for _ in range(take))
            self.holding.add(j.id)
            self.held += take
            k -= take
            if not k:
                return
        raise AssertionError("placed more workers than free slots")

    def release(self, j: Job, k: int) -> int:
        """Take k of `j`'s workers away (the last placed first); how many of them were training."""
        gone, j.workers = j.workers[len(j.workers) - k :], j.workers[: len(j.workers) - k]
        for n, _ in gone:
            self.unhold(j, n, 1)
        return sum(1 for w in gone if w[1] <= self.now)

    def unhold(self, j: Job, n: int, k: int) -> None:
        left = self.on_node[n][j.id] - k
        if not j.workers:
            self.holding.discard(j.id)
        if left:
            self.on_node[n][j.id] = left
        else:
            del self.on_node[n][j.id]
        if self.up[n]:
            self.free[n] += k
            self.free_total += k
            self.open.add(n)
        self.held -= k

    # ------------------------------------------------------------ the queue
    def key(self, j: Job) -> tuple:
        return (-j.priority, j.queued_at, j.id)

    def enqueue(self, j: Job) -> None:
        bisect.insort(self.queue, self.key(j))

    def dequeue(self, j: Job) -> None:
        i = bisect.bisect_left(self.queue, self.key(j))
        if i < len(self.queue) and self.queue[i] == self.key(j):
            self.queue.pop(i)

    # ------------------------------------------------------------ losses
    def lose_workers(self, j: Job, k_training: int) -> None:
        """An elastic job lost workers: their in-flight minibatches, and a pause while their remainder is leased."""
        cut = min(j.progress, self.costs.inflight_s * k_training)
        j.progress -= cut
        j.lost += cut
        if j.start_at <= self.now:
            j.paused_until = max(j.paused_until, self.now + self.costs.rescale_s)

    def restart(self, j: Job) -> None:
        """A gang job lost a worker: all of it restarts from its last checkpoint, queued again."""
        self.advance(j)
        j.lost += j.progress - j.ckpt_progress
        j.progress = j.ckpt_progress
        j.train_clock = 0.0
        j.start_at = math.inf
        j.restarts += 1
        self.release(j, len(j.workers))
        self.running.discard(j.id)
        j.version += 1  # its predicted end no longer holds
        self.enqueue(j)

    def reclaim(self, n: int) -> None:
        if not self.up[n]:
            return
        self.up[n] = False
        self.live_slots -= self.spn
        self.free_total -= self.free[n]
        self.free[n] = 0
        self.open.discard(n)
        for jid, k in list(self.on_node[n].items()):
            j = self.jobs[jid]
            if self.side == "elastic":
                self.advance(j)
                mine = [w for w in j.workers if w[0] == n]
                j.workers = [w for w in j.workers if w[0] != n]
                self.unhold(j, n, k)
                self.lose_workers(j, sum(1 for w in mine if w[1] <= self.now))
                self.dequeue(j)
                self.enqueue(j)
                self.touch(j)
            else:
                self.restart(j)
        self.push(self.now + self.node_down_s, "back", n)

    # ------------------------------------------------------------ scheduling
    def schedule(self) -> None:
        if self.side == "elastic":
            self.schedule_elastic()
        else:
            self.schedule_gang(strict=self.side == "kueue")

    def schedule_elastic(self) -> None:
        free = self.free_total
        for key in list(self.queue):
            j = self.jobs[key[2]]
            want = j.max_workers - len(j.workers)
            if want <= 0:
                self.dequeue(j)
                continue
            if free <= 0:
                if j.priority == LOW:
                    break  # below here nothing can preempt
                free += self.preempt_workers(j, want)
                if free <= 0:
                    continue
            k = min(want, free)
            self.advance(j)
            if j.start_at == math.inf:
                first = max(j.arrival + self.costs.job_start_s, self.now + self.costs.worker_start_s)
                j.start_at = first
            self.place(j, k, self.now + self.costs.worker_start_s)
            free -= k
            if len(j.workers) == j.max_workers:
                self.dequeue(j)
            self.touch(j)

    def preempt_workers(self, j: Job, want: int) -> int:
        """kube-scheduler preempts lower-priority workers for `j`'s pending ones: the youngest jobs' first."""
        freed = 0
        victims = sorted(
            (v for v in map(self.jobs.get, self.holding) if v.priority < j.priority),
            key=lambda v: (v.priority, -v.arrival),
        )
        for v in victims:
            if freed >= want:
                break
            k = min(want - freed, len(v.workers))
            self.advance(v)
            self.lose_workers(v, self.release(v, k))
            v.preempted += k
            freed += k
            if v.end is None:
                self.dequeue(v)
                self.enqueue(v)
            self.touch(v)
        return freed

    def schedule_gang(self, strict: bool) -> None:
        free = self.free_total
        for key in list(self.queue):
            if free <= 0 and key[0] == -LOW:
                break
            j = self.jobs[key[2]]
            need = j.max_workers
            if need > free and j.priority > LOW:
                free += self.evict_for(j, need - free)
            if need > free:
                if strict:
                    break
                continue
            self.dequeue(j)
            self.advance(j)
            self.place(j, need, self.now + self.costs.job_start_s)
            j.start_at = self.now + self.costs.job_start_s
            self.running.add(j.id)
            free -= need
            self.touch(j)

    def evict_for(self, j: Job, short: int) -> int:
        """Whole lower-priority jobs evicted (the most recently admitted first) if that makes `j` fit."""
        victims = sorted(
            (self.jobs[i] for i in self.running if self.jobs[i].priority < j.priority),
            key=lambda v: -v.start_at,
        )
        chosen, freed = [], 0
        for v in victims:
            if freed >= short:
                break
            chosen.append(v)
            freed += len(v.workers)
        if freed < short:
            return 0
        for v in chosen:
            v.preempted += 1
            self.restart(v)
        return freed


# ---------------------------------------------------------------- traces
def job_mix(nodes: int, mix: Mix, seed: int) -> list[Job]:
    rng = random.Random(seed)
    slots = nodes * mix.slots_per_node
    sizes = [s for s, _ in mix.sizes if s <= slots] or [slots]
    weights = [w for s, w in mix.sizes if s <= slots] or [1.0]
    n = max(2, round(mix.jobs_per_node * nodes))
    drawn = []
    for _ in range(n):
        size = rng.choices(sizes, weights)[0]
        length = mix.median_length_s * math.exp(rng.gauss(0.0, mix.length_sigma))
        drawn.append((size, size * length, HIGH if rng.random() < mix.high_fraction else LOW))
    mean_work = statistics.fmean(w for _, w, _ in drawn)
    rate = mix.load * slots / mean_work  # arrivals a second
    t, jobs = 0.0, []
    for i, (size, work, prio) in enumerate(drawn):
        jobs.append(Job(i, t, size, work, prio, queued_at=t))
        t += rng.expovariate(rate)
    return jobs


def reclaim_trace(nodes: int, mix: Mix, seed: int, horizon: float) -> list[tuple[float, int]]:
    if mix.reclaim_mtbf_h <= 0:
        return []
    rng = random.Random(seed * 7919 + 1)
    out = []
    for n in range(nodes):
        t = rng.expovariate(1.0 / (mix.reclaim_mtbf_h * 3600))
        while t < horizon:
            out.append((t, n))
            t += rng.expovariate(1.0 / (mix.reclaim_mtbf_h * 3600))
    return out


def simulate(side: str, nodes: int, jobs: list[Job], costs: Costs, mix: Mix, reclaims=()) -> dict:
    jobs = [dataclasses.replace(j, workers=[]) for j in jobs]
    c = Cluster(side, nodes, costs, mix, jobs, reclaims)
    c.run()
    unfinished = [j.id for j in jobs if j.end is None]
    if unfinished:
        raise AssertionError(f"{side}: jobs {unfinished[:5]} never finished")
    makespan = max(j.end for j in jobs) - min(j.arrival for j in jobs)
    useful = sum(j.work for j in jobs)
    jct = sorted(j.end - j.arrival for j in jobs)
    slots = nodes * mix.slots_per_node
    w = c.window
    return {
        "side": side,
        "nodes": nodes,
        "jobs": len(jobs),
        "makespan_s": makespan,
        # while jobs arrive: work done (net of work lost) and slots held, over the cluster's slots
        "utilization": w["net"] / (slots * w["span_s"]) if w["span_s"] else None,
        "allocation_arrivals": w["held"] / (slots * w["span_s"]) if w["span_s"] else None,
        "utilization_makespan": useful / (slots * makespan),
        "allocation": c.held_integral / (slots * makespan),
        "goodput": useful / c.held_integral,
        "jct_mean_s": statistics.fmean(jct),
        "jct_p95_s": jct[min(len(jct) - 1, math.ceil(0.95 * len(jct)) - 1)],
        "trained": sum(j.trained for j in jobs),
        "useful": useful,
        "lost": sum(j.lost for j in jobs),
        "restarts": sum(j.restarts for j in jobs),
        "preempted": sum(j.preempted for j in jobs),
        "job_ends": {j.id: j.end for j in jobs},
    }


# ---------------------------------------------------------------- validation against bench/gang.py
# bench/gang.py's two_jobs, measured: docs/benchmarks.md#gang-scheduling-against-elastic-workers (medians of 3 runs).
GANG_SLOTS, GANG_W = 8, 5
GANG_RECORDS = 450_000 * 2  # a job's records: --rows 450000, 2 epochs
GANG_RATE_PER_SLOT = 312.6  # records/s a worker: the middle of the measured range
GANG_MEASURED = {"elastic": 769.6, "gang": 1201.5}  # makespan, s: elastic-all (1-8 workers), Coscheduling (5 = 5)
GANG_MEASURED_RATIO = 0.647  # elastic-all / gang makespan, the median of the runs' ratios
VALIDATION_BOUND = 0.10


def validate(costs: Costs = Costs()) -> dict:
    """bench/gang.py's two_jobs on one node of 8 slots: B is submitted once A's workers run (at once here)."""
    mix = Mix(slots_per_node=GANG_SLOTS, reclaim_mtbf_h=0)
    work = GANG_RECORDS / GANG_RATE_PER_SLOT
    out = {}
    for side, size in (("elastic", GANG_SLOTS), ("gang", GANG_W)):
        jobs = [Job(0, 0.0, size, work), Job(1, 0.0, size, work, queued_at=1e-9)]
        out[side] = simulate(side, 1, jobs, costs, mix)["makespan_s"]
    ratio = out["elastic"] / out["gang"]
    measured = GANG_MEASURED_RATIO
    return {
        "simulated": out,
        "measured": GANG_MEASURED,
        "error": {side: out[side] / GANG_MEASURED[side] - 1 for side in out},
        "ratio": {"simulated": ratio, "measured": measured, "error": ratio / measured - 1},
    }


# ---------------------------------------------------------------- the bench
def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--seeds", type=int, default=3, help="traces per cluster size (seeds 0..N-1)")
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    p.add_argument("--json", type=pathlib.Path, help="write every run's figures here")
    p.add_argument("--validate-only", action="store_true")
    p.add_argument(
        "--svg",
        type=pathlib.Path,
        help="write PREFIX-utilization.svg, PREFIX-jct.svg, PREFIX-goodput.svg: median over seeds, min-max bars",
    )
    p.add_argument("--plot", type=pathlib.Path, help="simulate nothing: plot a --json file's runs (with --svg)")
    for f in dataclasses.fields(Costs):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=f.default)
    for name in ("jobs_per_node", "load", "median_length_s", "high_fraction", "reclaim_mtbf_h", "node_down_s"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(Mix, name))
    p.add_argument("--slots-per-node", type=int, default=Mix.slots_per_node)
    p.add_argument("--budget-s", type=float, default=900.0, help="stop starting new runs after this long")
    args = p.parse_args(argv)
    if args.plot:
        if not args.svg:
            p.error("--plot needs --svg PREFIX: where to write the plots")
        plot(json.loads(args.plot.read_text())["runs"], args.svg, args.plot.stem)
        return 0
    if min(args.nodes) < 1 or args.seeds < 1:
        p.error("--nodes and --seeds must be at least 1")
    costs = Costs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Costs)})
    mix = Mix(
        slots_per_node=args.slots_per_node,
        **{n: getattr(args, n) for n in ("jobs_per_node", "load", "median_length_s", "high_fraction")},
        reclaim_mtbf_h=args.reclaim_mtbf_h,
        node_down_s=args.node_down_s,
    )

    v = validate(costs)
    print("validation, bench/gang.py two_jobs (8 slots, 2 jobs of 5 workers):")
    for side in ("elastic", "gang"):
        print(
            f"  {side:8s} makespan simulated {v['simulated'][side]:7.1f} s, measured {v['measured'][side]:7.1f} s:"
            f" error {v['error'][side]:+.1%}"
        )
    r = v["ratio"]
    print(
        f"  elastic/gang makespan simulated {r['simulated']:.3f}, measured {r['measured']:.3f}: error {r['error']:+.1%}"
    )
    worst = max(abs(e) for e in (*v["error"].values(), r["error"]))
    print(f"  worst error {worst:.1%} (bound {VALIDATION_BOUND:.0%})")
    out = {"validation": v, "costs": dataclasses.asdict(costs), "mix": dataclasses.asdict(mix), "runs": []}
    if args.validate_only:
        return _write(args.json, out, worst)

    t0 = time.monotonic()
    for nodes in args.nodes:
        by_side: dict[str, list[dict]] = {s: [] for s in args.sides}
        for seed in range(args.seeds):
            if time.monotonic() - t0 > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: {nodes} nodes, seed {seed} and after not run")
                break
            jobs = job_mix(nodes, mix, seed)
            horizon = jobs[-1].arrival + 10 * sum(j.work for j in jobs) / (nodes * mix.slots_per_node)
            reclaims = reclaim_trace(nodes, mix, seed, horizon)
            for side in args.sides:
                t = time.monotonic()
                res = simulate(side, nodes, jobs, costs, mix, reclaims)
                res["seed"], res["wall_s"] = seed, round(time.monotonic() - t, 2)
                res.pop("job_ends")
                by_side[side].append(res)
                out["runs"].append(res)
        report(nodes, by_side, mix)
    print(f"simulated in {time.monotonic() - t0:.1f} s")
    if args.svg:
        plot(out["runs"], args.svg, f"reclaims every {mix.reclaim_mtbf_h:g} h a node")
    return _write(args.json, out, worst)


def report(nodes: int, by_side: dict[str, list[dict]], mix: Mix) -> None:
    base = by_side.get("elastic")
    n = min(len(r) for r in by_side.values())
    if not n:
        return
    print(
        f"\n{nodes} nodes ({nodes * mix.slots_per_node} slots), {by_side[next(iter(by_side))][0]['jobs']} jobs,"
        f" {n} seeds: median [min-max] over seeds"
    )
    print(f"  {'side':8s} {'utilization':>21s} {'goodput':>21s} {'JCT mean, s':>27s} {'JCT p95, s':>27s}  wall s")
    for side, runs in by_side.items():
        runs = runs[:n]

        def col(k, runs=runs):
            return spread([r[k] for r in runs])

        def col0(k, runs=runs):
            vals = [r[k] for r in runs]
            return f"{statistics.median(vals):9.0f} [{min(vals):.0f}-{max(vals):.0f}]"

        wall = max(r["wall_s"] for r in runs)
        print(
            f"  {side:8s} {col('utilization'):>21s} {col('goodput'):>21s} {col0('jct_mean_s'):>27s}"
            f" {col0('jct_p95_s'):>27s}  {wall:.1f}"
        )
    if base:
        for side, runs in by_side.items():
            if side == "elastic":
                continue
            for k in ("jct_mean_s", "jct_p95_s", "makespan_s", "utilization"):
                ratios = [r[k] / b[k] for r, b in zip(runs[:n], base[:n])]
                print(f"  {side}/elastic {k}: {spread(ratios)}")


# ---------------------------------------------------------------- plots (bench/plot.py draws them)
COLOURS = {"elastic": "#1b7837", "gang": "#b2182b", "kueue": "#2166ac"}
FIGURES = {
    "utilization": ("utilization while jobs arrive", 1.0),
    "jct": ("JCT, s: mean (solid), p95 (dashed)", None),
    "goodput": ("goodput (useful / allocated worker-s)", 1.0),
}


def plot(runs: list[dict], prefix: pathlib.Path, subtitle: str) -> None:
    """One SVG a figure: x the cluster's nodes (log), a line a side, the median over seeds, a bar min to max."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    nodes = sorted({r["nodes"] for r in runs})
    sides = [s for s in SIDES if any(r["side"] == s for r in runs)]
    for name, (title, top) in FIGURES.items():
        keys = [("jct_mean_s", ""), ("jct_p95_s", "6,4")] if name == "jct" else [(name, "")]
        lines = []
        for side in sides:
            for key, dash in keys:
                pts = []
                for n in nodes:
                    vals = [r[key] for r in runs if r["side"] == side and r["nodes"] == n and r[key] is not None]
                    if vals:
                        pts.append((n, statistics.median(vals), min(vals), max(vals)))
                lines.append((side, dash, pts))
        ymax = top or 1.1 * max(hi for _, _, pts in lines for *_, hi in pts)
        chart = log_lines(
            title, f"{subtitle}; median over seeds, bars min-max", nodes, "nodes (8 slots each)", ymax, lines, COLOURS
        )
        prefix.with_name(f"{prefix.name}-{name}.svg").write_text(chart)


def _write(path, out: dict, worst: float) -> int:
    if path:
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")
    return 0 if worst <= VALIDATION_BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
