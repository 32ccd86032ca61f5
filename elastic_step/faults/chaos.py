"""Chaos: fault injection for tests, benchmarks and the demo, fired on training progress through the
runtime's hook points (elastic_step/fault_hooks.py).

Specs of a job (`--chaos`, or ELASTIC_STEP_CHAOS comma-separated when the job has none; read at the
job's start by `for_job`):
- `kill:worker-0@400` SIGKILLs worker-0 once 400 records are committed and every worker is training
  (so each loss hits a job at full strength); `term:` sends SIGTERM instead (graceful scale-in). `@0`
  fires as soon as the job is at full strength.
- `preempt:worker-0@400` SIGKILLs worker-0 as a spot preemption does: once 400 records are committed and worker-0
  is training, whatever the others are doing. One that falls while worker-0 is down (being relaunched) fires once
  it trains again, and it holds back no preemption of another worker: each worker is preempted on its own, so a
  replayed preemption trace fires whole, as it does on a peer that restarts its job (bench/churn.py).
- `kill:ps-1@900` SIGKILLs a parameter server once 900 records are committed (`term:` SIGTERMs it).
- `kill:master@900` SIGKILLs the master itself once 900 records are committed (a lost step pod; run
  the step again with the same job id and output to resume it); `kill:master@checkpoint=2` does it
  after checkpoint 2's parts are written and before its manifest is (a master lost mid-checkpoint).
  `term:master@900` SIGTERMs it instead (the step's pod evicted or preempted, with a grace period).
- `stop:worker-1@400` freezes worker-1 (SIGSTOP) once 400 records are committed, mid-lease and after its first
  commit, as a worker that deadlocks, hangs on a read or is cut off from the network: it keeps its lease and says
  nothing, and the master must declare it hung (master/gray/hang.py). `stop:ps-0@400` freezes a parameter server:
  the master's probe finds it silent (master/gray/ps_watch.py) and handles it as a lost PS. Not the master: its own
  liveness is the step's health endpoint, which the platform probes.
  `stop:worker-1@400:resume` makes it a zombie: once the master declares it hung (and fences it), it is resumed
  (SIGCONT) before its kill, and the kill waits up to ZOMBIE_KILL_AFTER_S for it to end by itself, as a pod in its
  grace period or a partitioned node whose network returns. Fenced, it must apply nothing, and exit.
  The local backend only (a backend that cannot reach into its instances' processes refuses it at the job's start).
- `slow:worker-1@0:x10` slows worker-1 ten times from its start (every launch of it, as a slow node
  would): after each step but its first it sleeps 9 times as long as the step took, still reporting: never more than
  a quarter of the master's hang bound at a time (an allreduce run commits two steps or more), however loaded the
  machine, or it would be a hang, not a slow node. The master
  hands the factor to the worker's process (process.py, ELASTIC_STEP_SLOW). `slow:worker-1@400:x10` slows it
  once 400 records are committed (a node that turns slow), and every launch of it after that: the master opens
  a gate, a file its process looks for after each step, so it reaches workers that share the master's
  filesystem (the local backend, the test kubelet), not pods on other nodes.
- `random:4` or `random:4:seed=7`: a seeded random schedule of 4 signals, SIGKILL or SIGTERM, at
  record counts drawn over the job's first 90 %. Each goes to a worker that holds a lease when it
  fires (the seed ranks the workers), without waiting for full strength, so several fire in a run
  even while replacements are still starting. `random:4:seed=7:roles=worker,ps,master` also draws
  each signal's target among the roles listed: a parameter server (by index), or the master itself,
  whose step must then be run again (same job id and output), as a retry policy does.
  `random:4:seed=7:actions=kill,term,stop` draws each signal's action among those listed (`stop`:
  with roles among worker and ps). Without `actions=`, a seed draws the schedule it always drew.

A signal to a worker lands right after a commit of its lease (or a lease just granted) with minibatches of the
lease still to commit (MINIBATCHES_LEFT), so that it cuts the lease short and leaves a remainder to requeue.
Nothing fires on wall time: a slower machine sees the same schedule at the same progress. A signal due
while a checkpoint is being cut waits for it: the cut was due first, at fewer records. What fired goes
into summary.json (`chaos.fired`), so a test can fail loudly when its chaos never did.
With checkpoints on, it also goes to `chaos.json` beside them as it fires: a retried step (the same
job, the same specs) skips what its predecessors fired, and reports it with its own.

A worker's own faults (ELASTIC_STEP_COLLECTIVE_CHAOS, and a slow worker's ELASTIC_STEP_SLOW) are in
process.py: a worker process installs them without the master's machinery.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import tempfile
import threading
from collections.abc import Sequence

from elastic_step import fault_hooks
from elastic_step.backends.api import Backend, InstanceId
from elastic_step.errors import ConfigError, ElasticStepError
from elastic_step.faults.process import SLOW_ENV, SLOW_MAX_ENV, kill_self
from elastic_step.util.json_text import write_json

log = logging.getLogger("elastic_step.master")

ENV = "ELASTIC_STEP_CHAOS"  # a job's specs, when it is given none

ACTIONS = ("kill", "term")  # what a random schedule draws unless asked for others (`actions=`)
SIGNALS = (*ACTIONS, "stop")
MASTER = "master"  # a signal's target: the master itself
ROLES = ("worker", "ps", MASTER)
SPEC_HELP = (
    "use kill:worker-0@400, preempt:worker-0@400, term:worker-1@900, stop:worker-1@400, stop:worker-1@400:resume, "
    "slow:worker-1@0:x10, "
    "slow:worker-1@400:x10, "
    "random:4:seed=7, "
    "random:4:seed=7:roles=worker,ps,master, random:4:seed=7:actions=kill,term,stop, kill:master@900, "
    "term:master@900 or kill:master@checkpoint=2"
)
STOP_NOT_MASTER = (
    "stop freezes workers and parameter servers, not the master: a frozen master is the step's health endpoint's "
    "to report (its liveness probe restarts the step)"
)
# A signal to a worker lands with at least this many minibatches of its lease still to commit, more than the reports
# on their way usually hold: the signal cuts the lease short, and leaves a remainder to requeue.
MINIBATCHES_LEFT = 4
ZOMBIE_KILL_AFTER_S = 60.0  # stop:...:resume: the most a resumed worker's kill waits for it to end by itself


@dataclasses.dataclass
class Signal:
    action: str  # kill | term | stop | slow
    at: int  # records committed
    target: InstanceId | str | None  # None: a worker holding a lease, ranked by `rank`; or MASTER
    rank: list[int] = dataclasses.field(default_factory=list)
    index: int = 0  # its place in the job's schedule
    factor: float = 1.0  # slow: how many times slower
    resume: bool = False  # stop: resumed once declared hung, before its kill (a zombie)
    preempt: bool = False  # kill: as a preemption, once its worker trains, whatever the job's strength


def specs(configured: Sequence[str] = ()) -> tuple[str, ...]:
    """A job's specs: those it was given (`--chaos`), else ELASTIC_STEP_CHAOS's, so that a pipeline's
    training step can be disturbed from outside."""
    return tuple(configured) or tuple(c for c in os.environ.get(ENV, "").split(",") if c)


def for_job(
    configured: Sequence[str], records_total: int, max_workers: int, num_ps: int = 0, hang_bound_s: float = 0.0
) -> fault_hooks.JobFaults:
    """A job's hook points, at its start: its chaos, or none at all (a bad spec raises here, before
    anything starts). `hang_bound_s`: the shortest time between commits the master declares a worker hung after."""
    asked = specs(configured)
    return Chaos(list(asked), records_total, max_workers, num_ps, hang_bound_s) if asked else fault_hooks.NO_FAULTS


# A slowed step's pause is at most the hang bound over this: between two commits an allreduce member takes at least
# two steps (a run ends at the step after it lasted 0.1 s), each with its compute besides the pause.
SLOW_PAUSES_PER_BOUND = 4


class Chaos(fault_hooks.JobFaults):
    """A job's chaos: its schedule of signals, fired on the master's ticks (see the module)."""

    def __init__(
        self, specs: list[str], records_total: int, max_workers: int, num_ps: int = 0, hang_bound_s: float = 0.0
    ):
        self.max_workers = max_workers
        self.hang_bound_s = hang_bound_s
        self.pending: list[Signal] = []
        self.fired: list[dict] = []
        self.kill_at_checkpoint: int | None = None
        self.journal: str | None = None  # chaos.json beside the checkpoints (see resume)
        self._job_id = ""
        for s in specs:
            if s.startswith("kill:master@checkpoint="):
                self.kill_at_checkpoint = self._number(s, s.rsplit("=", 1)[1])
                continue
            self.pending += self._parse(s, records_total, max_workers, num_ps)
        self.pending.sort(key=lambda sig: sig.at)
        for i, sig in enumerate(self.pending):
            sig.index = i
        self.schedule = [
            {
                "action": sig.action,
                "at_records": sig.at,
                "instance": str(sig.target) if sig.target else "any worker holding a lease",
                **({"factor": sig.factor} if sig.action == "slow" else {}),
                **({"resume": "once declared hung"} if sig.resume else {}),
                **({"preempt": True} if sig.preempt else {}),
            }
            for sig in self.pending
        ]
        # slow: the workers to slow (`instance_env`): from their start, or from a gate the signal opens
        slowed = [sig for sig in self.pending if sig.action == "slow"]
        if len({sig.target for sig in slowed}) < len(slowed):
            raise ElasticStepError(f"--chaos {specs}: one slow: spec per worker.")
        self.slow = {sig.target: sig for sig in slowed}
        self._gates = tempfile.mkdtemp(prefix="elastic-step-slow-") if any(sig.at for sig in slowed) else ""
        self.zombies: set[InstanceId] = set()  # frozen by a stop:...:resume, to resume once declared hung
        self.resumed: list[dict] = []
        self._marks: dict[str, int] | None = None  # each leased worker's watermark at the last tick (see _cuttable)
        if self.kill_at_checkpoint is not None:
            self.schedule.append({"action": "kill", "instance": "master", "at_checkpoint": self.kill_at_checkpoint})

    @staticmethod
    def _parse(spec: str, records_total: int, max_workers: int, num_ps: int) -> list[Signal]:
        try:
            kind, rest = spec.split(":", 1)
            if kind == "random":
                count, *options = rest.split(":")
                opts = dict(o.split("=", 1) for o in options)
                roles = opts.get("roles", "worker").split(",")
                actions = opts["actions"].split(",") if "actions" in opts else None
                if (
                    set(opts) - {"seed", "roles", "actions"}
                    or int(count) < 1
                    or not roles
                    or set(roles) - set(ROLES)
                    or (actions is not None and (not actions or set(actions) - set(SIGNALS)))
                ):
                    raise ValueError
                if "ps" in roles and num_ps < 1:
                    raise ElasticStepError(
                        f"--chaos {spec!r} targets parameter servers, and this job has none "
                        "(--strategy allreduce): leave ps out of roles=."
                    )
                if actions and "stop" in actions and MASTER in roles:
                    raise ElasticStepError(f"--chaos {spec!r}: {STOP_NOT_MASTER}; leave master out of roles=.")
                rng = random.Random(int(opts.get("seed", 0)))
                signals = []
                for _ in range(int(count)):
                    sig = Signal(
                        rng.choice(actions or ACTIONS),
                        rng.randint(1, max(1, int(records_total * 0.9))),
                        None,
                        rng.sample(range(max_workers), max_workers),
                    )
                    role = rng.choice(roles) if len(roles) > 1 else roles[0]  # workers only: seeds as before
                    if role == MASTER:
                        sig.target = MASTER
                    elif role == "ps":
                        sig.target = InstanceId("ps", rng.randrange(num_ps))
                    signals.append(sig)
                return signals
            name, at = rest.split("@", 1)
            if kind == "preempt":
                if not name.startswith("worker-") or int(at) < 0:
                    raise ValueError
                return [Signal("kill", int(at), InstanceId("worker", int(name.removeprefix("worker-"))), preempt=True)]
            if kind == "slow":
                at, times = at.split(":x", 1)
                target = InstanceId("worker", int(name.removeprefix("worker-")))
                if not name.startswith("worker-") or not float(times) > 1 or int(at) < 0:
                    raise ValueError
                return [Signal("slow", int(at), target, factor=float(times))]
            if name == "master" and kind in ACTIONS and int(at) >= 0:
                return [Signal(kind, int(at), MASTER)]
            if kind == "stop" and name == MASTER:
                raise ElasticStepError(f"--chaos {spec!r}: {STOP_NOT_MASTER}.")
            at, resume = at.split(":", 1) if kind == "stop" and ":" in at else (at, "")
            if resume not in ("", "resume"):
                raise ValueError
            if resume and not name.startswith("worker-"):
                zombie = "resume makes a zombie of a worker only"
                raise ElasticStepError(f"--chaos {spec!r}: {zombie}; use stop:{name}@{at}.")
            role, index = name.rsplit("-", 1)
            if kind not in SIGNALS or role not in ("worker", "ps") or int(at) < 0:
                raise ValueError
            return [Signal(kind, int(at), InstanceId(role, int(index)), resume=bool(resume))]
        except ValueError:
            raise ElasticStepError(f"Bad --chaos spec {spec!r}: {SPEC_HELP}.") from None

    @staticmethod
    def _number(spec: str, text: str) -> int:
        if not text.isdigit():
            raise ElasticStepError(f"Bad --chaos spec {spec!r}: {SPEC_HELP}.")
        return int(text)

    def resume(self, journal: str, job_id: str, resumable: bool = True) -> None:
        """Keep what fires in `journal` (chaos.json beside the checkpoints). A retried step of the same job
        skips what its predecessors fired, whether or not a checkpoint let it resume: the same specs make
        the same schedule, and each signal fires once per job (else a master killed on schedule would be
        killed again at the same progress, by every retry)."""
        self.journal, self._job_id = journal, job_id
        if not resumable:
            return
        try:
            import fsspec

            with fsspec.open(journal, "r") as f:
                saved = json.load(f)
            same = saved.get("job_id") == job_id and saved.get("schedule") == self.schedule
            before = saved["fired"] if same else []  # another job, or other specs: a schedule of its own
        except (OSError, ValueError, KeyError, TypeError):
            return
        done = {f["index"] for f in before}
        self.fired = [{**f, "by_previous_master": True} for f in before]
        self.pending = [sig for sig in self.pending if sig.index not in done]
        if done:
            log.info(
                "chaos: %d signal(s) of the schedule were fired by a previous master; %d to go",
                len(done),
                len(self.pending),
            )

    def _fire(self, sig: Signal, instance: str, committed: int) -> None:
        self.pending.remove(sig)
        self._marks = None  # the next signal tells moves from its own ticks' watermarks, not from this one's
        self.fired.append({"action": sig.action, "instance": instance, "at_records": committed, "index": sig.index})
        if self.journal is not None:  # before the signal: a master that kills itself must leave it written
            write_json(
                self.journal, {"job_id": self._job_id, "schedule": self.schedule, "fired": self.fired}, indent=None
            )

    def instance_env(self, inst: InstanceId) -> dict[str, str]:
        """A slowed worker's process learns its factor from its environment, at every launch: slow from its start,
        or once its gate opens (a signal at R > 0 still pending)."""
        sig = self.slow.get(inst)
        if sig is None:
            return {}
        env = {SLOW_ENV: f"{sig.factor:g}" + (f"@{self._gate(sig)}" if sig in self.pending and sig.at else "")}
        if self.hang_bound_s > 0:  # a slow worker still reports: its pauses never reach the master's hang bound
            env[SLOW_MAX_ENV] = f"{self.hang_bound_s / SLOW_PAUSES_PER_BOUND:g}"
        return env

    def _gate(self, sig: Signal) -> str:
        return os.path.join(self._gates, str(sig.target))

    def kill_deferred(self, inst: InstanceId, backend: Backend) -> float:
        """A zombie (stop:...:resume) was declared hung and fenced: resume it, and let its kill wait."""
        if inst not in self.zombies:
            return 0.0
        self.zombies.discard(inst)
        backend.thaw(inst)
        self.resumed.append({"action": "resume", "instance": str(inst)})
        log.warning("chaos: %s resumed (SIGCONT) after it was declared hung, before its kill: a zombie", inst)
        return ZOMBIE_KILL_AFTER_S

    def checkpoint_written(self, ckpt_id: int) -> None:
        """Called between a checkpoint's parts and its manifest: the master dies there, if asked to."""
        if ckpt_id == self.kill_at_checkpoint:
            log.warning("chaos: SIGKILL the master between checkpoint %d's parts and its manifest", ckpt_id)
            kill_self(signal.SIGKILL)

    def check_backend(self, backend: Backend) -> None:
        """A `stop` this backend cannot deliver fails the job at its start, not when it is due mid-training."""
        if any(sig.action == "stop" for sig in self.pending) and not backend.can_freeze:
            raise ConfigError(backend.cannot_freeze())

    def tick(self, committed: int, backend: Backend, coord) -> None:
        """Fire the next signal whose threshold has passed, if its target is ready (one per tick)."""
        if not self.pending or committed < self.pending[0].at:
            return
        sig = self.pending[0]
        if sig.target == MASTER:
            self._signal_master(sig, committed)
            return
        if sig.action == "stop" and self.zombies:
            # One freeze at a time: a PS frozen beside a frozen worker holds that worker's hang clock (by design),
            # and the worker would never be declared hung and resumed.
            return
        alive = backend.alive()
        if sig.action == "slow":
            self._slow_down(sig, committed, coord)
            return
        if sig.preempt:
            sig, target = self._ready_preemption(committed, alive, coord)
        else:
            target = self._ready_target(sig, alive, coord)
        if target is None:
            return
        if sig.action == "kill" and coord.rendezvous is not None and target.role == "worker":
            # allreduce: a run the victim already reported ready would otherwise commit with the others' reports
            # before its loss is seen, and leave nothing to requeue. Its lease is checked again under the lock runs
            # commit under: a run that committed since this tick's look ended the lease, so the kill waits.
            if not coord.rendezvous.leave(str(target), lambda: self._untouched(coord, str(target))):
                return
        self._fire(sig, str(target), committed)
        coord.timeline.record("chaos", str(target), f"{sig.action} at {committed} records")
        log.info("chaos: %s %s at %d committed records (planned at %d)", sig.action, target, committed, sig.at)
        if sig.action == "kill":
            backend.kill(target)
        elif sig.action == "stop":
            backend.freeze(target)
            if sig.resume:
                self.zombies.add(target)
        else:
            threading.Thread(target=backend.stop, args=(target, 30.0), daemon=True).start()

    def _signal_master(self, sig: Signal, committed: int) -> None:
        """SIGKILL: a lost step pod, nothing cleaned up or flushed. SIGTERM: the pod stopped with a grace period,
        which the master's own handler uses."""
        self._fire(sig, MASTER, committed)
        number = signal.SIGKILL if sig.action == "kill" else signal.SIGTERM
        log.warning("chaos: %s the master at %d committed records", number.name, committed)
        kill_self(number)

    def _slow_down(self, sig: Signal, committed: int, coord) -> None:
        """At 0, launched slow (instance_env): it fires, for the record, once the worker is training. Later, the
        gate its process looks for opens."""
        if sig.target in coord.membership.training():
            if sig.at:
                open(self._gate(sig), "w").close()
            self._fire(sig, str(sig.target), committed)
            since = f"at {committed} records" if sig.at else "from its start"
            coord.timeline.record("chaos", str(sig.target), f"slow x{sig.factor:g} {since}")
            log.info("chaos: %s runs %g times slower %s", sig.target, sig.factor, since)

    def _ready_target(self, sig: Signal, alive: set[InstanceId], coord) -> InstanceId | None:
        """The instance `sig` lands on now, or None while none is ready for it."""
        leased = self._cuttable(coord)
        if sig.action == "stop":
            # A freeze lands after the worker's first commit of its launch: before it, a freeze is a start-up hang,
            # which has a bound of minutes (master/gray/hang.py), not the one a test gives.
            leased = {w for w in leased if coord.hangs.idle(w) is not None}
            if coord.rendezvous is not None and any(coord.hangs.idle(m) is None for m, _ in coord.rendezvous.members):
                # allreduce: on a ring whose members have all committed. A newcomer still joining would find the frozen
                # member unreachable first (its pull, its ring endpoint) and have it leave as lost, not as hung.
                leased = set()
        if sig.target is not None and sig.target.role == "ps":
            if sig.target not in alive or coord.rewinding:  # one loss at a time: not while restoring
                return None
            if sig.action == "stop" and coord.ledger.done:
                # Training is over: a freeze now only holds the master's final pull of the model (not yet handled: it
                # fails the job after the pull's deadline), and tests nothing of training.
                return None
            return sig.target
        if sig.target is not None:
            # In threshold order, each at full strength (the workers the job keeps: not those it left out for
            # good) and while its target holds a lease, so the signal cuts a task short and leaves a remainder,
            # whatever this machine's speed.
            if (
                len(coord.membership.training()) < self.max_workers - len(coord.retired)
                or sig.target not in alive
                or str(sig.target) not in leased
            ):
                return None
            return sig.target
        ready = [
            InstanceId("worker", i) for i in sig.rank if InstanceId("worker", i) in alive and f"worker-{i}" in leased
        ]
        return ready[0] if ready else None

    def _ready_preemption(self, committed: int, alive: set[InstanceId], coord) -> tuple[Signal, InstanceId | None]:
        """The first due preemption, in threshold order, whose worker trains (alive, committed since its launch, with
        a lease to cut short), and that worker; a preemption whose worker is down (or still starting) waits for it
        alone. (pending[0], None) while none is ready."""
        leased = self._cuttable(coord)  # once a tick: it keeps the watermarks it tells moves from
        for sig in self.pending:
            if sig.at > committed or not sig.preempt:
                break  # a due signal of another kind keeps its place in the order
            # After the launch's first commit: a relaunched worker killed before it would count as a crash loop.
            member = coord.membership.members.get(sig.target)
            if sig.target in alive and str(sig.target) in leased and member and member.progress_since_launch:
                return sig, sig.target
        return self.pending[0], None

    def _cuttable(self, coord) -> set[str]:
        """The workers a signal would cut short now: their lease's watermark moved since the last tick (a commit, or
        a lease just granted), so what they compute now is not yet reported, and MINIBATCHES_LEFT of it are still to
        commit. A lease that one report ends (a run of allreduce steps) is cut this way only, just granted; the
        ring holds its run's commit from the kill to the loss (Rendezvous.leave), so a report already on its way
        cannot end it either."""
        leases = coord.ledger.leases
        marks, self._marks = self._marks, {w: lease.watermark for w, lease in leases.items()}
        if marks is None:
            return set()  # the first tick: nothing to tell a move from
        # get: None, no lease then
        return {w for w, lease in leases.items() if marks.get(w) != lease.watermark and _left(coord, lease)}

    def _untouched(self, coord, worker: str) -> bool:
        """Whether `worker`'s lease is as _cuttable saw it this tick: nothing of it reported since, and
        MINIBATCHES_LEFT of it still to commit."""
        lease = coord.ledger.leases.get(worker)
        marks = self._marks or {}
        return lease is not None and marks.get(worker) == lease.watermark and _left(coord, lease)

    def summary(self) -> dict | None:
        if not self.schedule:
            return None
        return {
            "schedule": self.schedule,
            "fired": list(self.fired),
            "not_fired": [{"action": s.action, "at_records": s.at} for s in self.pending],
            **({"resumed": list(self.resumed)} if self.resumed else {}),
        }

    def close(self) -> None:
        """The job's instances are stopped: nobody looks for a slow worker's gate any more."""
        if self._gates:
            shutil.rmtree(self._gates, ignore_errors=True)


def _left(coord, lease) -> bool:
    """Whether MINIBATCHES_LEFT of `lease` are still to commit."""
    return lease.task.end - lease.watermark >= MINIBATCHES_LEFT * coord.ledger.minibatch_size
