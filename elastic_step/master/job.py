"""The elastic master for the length of a training step.

Cuts the data into tasks, starts PS shards and workers through a backend, reacts to their
events (requeue a lost worker's remainder at once, relaunch it), shows progress, and at the
end evaluates, exports the model and writes `summary.json`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import shutil
import signal
import tempfile
import threading
import time

from elastic_step import fault_hooks
from elastic_step.backends.api import Backend, EventKind, InstanceId, InstanceSpec
from elastic_step.backends.preloaded import fork_preloader
from elastic_step.data.manifest import load_manifest
from elastic_step.data.shuffle import usable_cpus
from elastic_step.errors import ConfigError, ElasticStepError, JobFailed, StepTerminated
from elastic_step.faults import chaos
from elastic_step.instance.api import LAUNCH_ENV, TOKEN_ENV, instance_argv
from elastic_step.master.api import TrainConfig
from elastic_step.master.curve import EvalCurve, ShardPuller
from elastic_step.master.data_check import check_splits
from elastic_step.master.durability.audit import EXACT, audit, describe
from elastic_step.master.durability.checkpoint import JobCheckpoints
from elastic_step.master.early_stop import EarlyStop
from elastic_step.master.failures import FailureReports
from elastic_step.master.gray.hang import HangBounds
from elastic_step.master.gray.policy import GrayFailures
from elastic_step.master.health import Health, serving
from elastic_step.master.input_server import InputServer
from elastic_step.master.leases.coordinator import Coordinator
from elastic_step.master.leases.ledger import AUTO_MIN_TASKS_PER_EPOCH, AUTO_MINIBATCHES_PER_TASK, Ledger, ShardInfo
from elastic_step.master.observe import goodput
from elastic_step.master.observe.goodput import Goodput
from elastic_step.master.observe.metrics import JobMetrics, JobState
from elastic_step.master.observe.notices import Notices
from elastic_step.master.plan import JobPlan, checked, checkpoint_root, new_job_id, new_token
from elastic_step.master.progress import Progress
from elastic_step.master.relaunch import RelaunchPolicy, loss_cause
from elastic_step.master.service import MasterService, serve
from elastic_step.master.skipped import SkippedMinibatches
from elastic_step.master.tensorboard import TensorBoardLog
from elastic_step.master.threads import HEAVY_MINIBATCH, multiply_adds, pools_env, worker_inter_op, worker_intra_op
from elastic_step.master.timeline import Timeline
from elastic_step.optimizers import finalize
from elastic_step.report import write_report
from elastic_step.util import logs, phases
from elastic_step.util.json_text import write_json
from elastic_step.util.storage import check_writable, copy_folder, explain
from elastic_step.util.uri import local_path

log = logging.getLogger("elastic_step.master")

PUMP_TURN_S = 0.1  # the pump waits this long for a backend event, at most, between turns
BARRIER_POLL_S = 0.002  # ... and this long while a checkpoint's barrier is up
SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.html"


def make_backend(cfg: TrainConfig, job_id: str, log_dir: pathlib.Path) -> tuple[Backend, str]:
    """The job's backend, started, and the job's token. --backend auto picks one (its `name` says which)."""
    if cfg.backend == "auto":
        return _auto_backend(cfg, job_id, log_dir)
    return _backend(cfg.backend, cfg, job_id, log_dir)


def _backend(name: str, cfg: TrainConfig, job_id: str, log_dir: pathlib.Path) -> tuple[Backend, str]:
    if name == "local":
        from elastic_step.backends.local import LocalBackend

        token = new_token()
        return LocalBackend(log_dir, env={TOKEN_ENV: token}, preload=True), token
    if name == "kubernetes":
        # Namespace, credentials, owner pod and pod-spec additions come from the environment (see the
        # module). A restarted master finds the job's Secret and keeps its token.
        from elastic_step.backends.kubernetes import KubernetesBackend

        backend = KubernetesBackend.from_train_config(cfg, job_id=job_id, token=new_token())
        return backend, backend.token
    raise ConfigError(f"Unknown backend {name!r}; use auto, local or kubernetes.")


def _auto_backend(cfg: TrainConfig, job_id: str, log_dir: pathlib.Path) -> tuple[Backend, str]:
    """--backend auto: pods when this step runs in a pod whose service account holds the Role's verbs
    (so a training component dragged into a cluster pipeline is an elastic job of pods), else processes
    of this step. The plan records the choice, and the log says why."""
    from elastic_step.backends.kubernetes.config import in_cluster
    from elastic_step.backends.kubernetes.errors import KubernetesPermissionError

    if in_cluster():
        try:
            started = _backend("kubernetes", cfg, job_id, log_dir)
        except KubernetesPermissionError as e:  # checked before the backend creates anything
            why = f"this step runs in a pod, but {e}"
        else:
            log.info(
                "backend auto -> kubernetes: this step runs in a pod whose service account may run the "
                "job's pods in namespace %s",
                started[0].namespace,
            )
            return started
    else:
        why = "this step does not run in a Kubernetes pod (no service-account token)"
    log.info("backend auto -> local: workers and parameter servers run as processes of this step; %s", why)
    return _backend("local", cfg, job_id, log_dir)


def _inputs(cfg: TrainConfig):
    """The training data's manifest, the eval data's (or None) and the model definition, checked against each
    other: a bad contract, or eval data the model cannot take, fails here, before anything starts."""
    from elastic_step.data import statistics_of
    from elastic_step.model_def import load_model_def

    train = load_manifest(cfg.train_data)
    evaluation = load_manifest(cfg.eval_data) if cfg.eval_data else None
    model_def = load_model_def(cfg.model_def, statistics_of(train.uri))  # model(statistics) reads the training data's
    check_splits(model_def, train, evaluation)
    return train, evaluation, model_def


def _ledger(cfg: TrainConfig, train, hold_epochs: bool) -> Ledger:
    """The training data's tasks, leased epoch by epoch; `hold_epochs`: each epoch's end waits for its eval point
    (early stopping)."""
    ledger = Ledger(
        [ShardInfo(train.shard_uri(s), s.rows) for s in train.shards],
        cfg.records_per_task,
        cfg.epochs,
        cfg.minibatch_size,
        cfg.seed,
    )
    ledger.hold_epochs = hold_epochs
    return ledger


class TrainingJob:
    def __init__(
        self,
        cfg: TrainConfig,
        backend: Backend | None = None,
        staging: str | None = None,
        health: Health | None = None,
        metrics: JobMetrics | None = None,
    ):
        """`backend`: one already started (tests), else the config's; `staging`: a local folder the job
        writes in, for an output in an object store that train() uploads at the end; `health`: what the
        step's health endpoint answers from (train() serves it), told of every turn of the pump; `metrics`: the
        registry the step's /metrics serves (train() serves it), which the job's figures join."""
        self.cfg = checked(cfg)
        self.health = health or Health()
        self.goodput = Goodput()  # from the master's start: its start-up is part of the step's time
        job_id = cfg.job_id or new_job_id()
        output = staging or cfg.output
        self.output = pathlib.Path(output)  # where this job writes
        self.train, self.eval, self.model_def = _inputs(cfg)
        self.early_stop = (
            EarlyStop(cfg.early_stop_metric, cfg.early_stop_patience, cfg.early_stop_min_delta)
            if cfg.early_stop_metric
            else None
        )
        self.ledger = _ledger(cfg, self.train, hold_epochs=self.early_stop is not None)
        self.allreduce = cfg.strategy == "allreduce"
        self.bounds = HangBounds(cfg.hang_timeout)  # every watch's, and what a pull from a frozen member waits
        self.timeline = Timeline()  # what happened when (summary.json, the report)
        self.coord = Coordinator(
            self.ledger,
            0 if self.allreduce else cfg.num_ps,
            cfg.min_workers,
            self.bounds,
            self.timeline,
            ring_max_workers=cfg.max_workers if self.allreduce else None,
            members_lost=lambda: self.durable.members_lost(),  # the job's checkpoints, made below
        )
        self.failures = FailureReports(self.timeline, job_failed=self.coord.finished.set)
        self.skipped = SkippedMinibatches(self.timeline)
        self.relaunch = RelaunchPolicy(cfg.max_relaunches)
        # Fault injection's hook points (tests, benchmarks, the demo); nothing in production.
        self.faults = chaos.for_job(
            cfg.chaos,
            self.ledger.records_per_epoch * cfg.epochs,
            cfg.max_workers,
            0 if self.allreduce else cfg.num_ps,
            hang_bound_s=self.bounds.least,
        )
        # Checkpoints, and a resumed job's ledger back at its last cut, before anything starts.
        ckpt_root = checkpoint_root(cfg.checkpoint_uri, cfg.output, job_id)
        self.durable = JobCheckpoints(
            cfg, job_id, ckpt_root, self.model_def, self.coord, token=lambda: self.plan.token, faults=self.faults
        )
        self.backend, self.plan = self._start_backend(backend, job_id, output, ckpt_root)
        self.notices = Notices(self.backend.tell, self.timeline.events)  # on Kubernetes, Events on the step's pod
        # Hung workers, silent shards, ring stragglers: given up, fenced and stopped (master/gray/).
        self.gray = GrayFailures(
            self.coord,
            self.backend,
            self.faults,
            retire=self.relaunch.retire,
            token=self.plan.token,
            allreduce=self.allreduce,
            bounds=self.bounds,
        )
        if self.durable.cutter is not None:  # a retried step goes on with the schedule, not over it
            self.faults.resume(self.durable.store.uri("chaos.json"), job_id, cfg.resume == "auto")
        self.progress = Progress(cfg.progress, self.ledger.records_per_epoch, cfg.epochs)
        self.tensorboard = TensorBoardLog.for_job(output, self.ledger.records_per_epoch)
        self.train_seconds = 0.0
        self._multiply_adds: int | None = None  # a minibatch's, counted at the first launch (_minibatch_multiply_adds)
        self.terminated_at: float | None = None  # SIGTERM: the step is being stopped
        self.eval_history: list[dict] = self.durable.eval_history
        self.curve = self._eval_curve() if self.eval is not None else None
        self._input_server: InputServer | None = None
        self.observed = metrics.watch(self._state()) if metrics is not None else None

    def _state(self) -> JobState:
        """What /metrics reads of this job when scraped."""
        return JobState(
            job_id=self.plan.job_id,
            coord=self.coord,
            goodput=self.goodput,
            hung=lambda: self.gray.given_up()[0],
            left_out=lambda: self.gray.given_up()[1],
            relaunches=lambda: self.relaunch.relaunches,
            checkpoints=self.durable.summary,
            evaluation=lambda: self.eval_history[-1] if self.eval_history else {},
        )

    @contextlib.contextmanager
    def _busy(self, what: str, cause: str):
        """Work that holds the pump (`what`, for the health endpoint), its time spent on `cause` (goodput.py)."""
        with self.health.busy(what), self.goodput.doing(cause):
            yield

    def _start_backend(
        self, given: Backend | None, job_id: str, output: str, checkpoint_root: str
    ) -> tuple[Backend, JobPlan]:
        """The job's backend and its plan, which records the backend and its token: `given` (tests: a Kubernetes
        backend made for this job, with its token), else the config's, which starts processes: after every check.
        Closed again when the job's faults cannot run on it."""
        if given is not None:
            if getattr(given, "job_id", job_id) != job_id:
                raise ValueError(f"the backend given is job {given.job_id}'s, not {job_id}'s")
            backend, token = given, given.token
        else:
            backend, token = make_backend(self.cfg, job_id, self.output / "logs")
        try:
            self.faults.check_backend(backend)
        except ConfigError:
            backend.close()
            raise
        plan = JobPlan(
            job_id=job_id,
            output=output,
            output_uri=self.cfg.output,
            checkpoint_root=checkpoint_root,
            backend=backend.name,
            token=token,
        )
        return backend, plan

    def _eval_curve(self) -> EvalCurve:
        """The eval curve, pulling the weights from the shards (ps) or from a member of the ring (allreduce)."""
        pull = (
            self._load_from_rank0
            if self.allreduce
            else ShardPuller(self.coord.shard_addresses, self.plan.token, self.cfg.num_ps)
        )
        return EvalCurve(
            self.model_def,
            self.eval,
            self.coord,
            self.eval_history,
            self.tensorboard,
            pull,
            self.failures,
            early_stop=self.early_stop,
        )

    # ------------------------------------------------------------------ launching
    def _spec(self, inst: InstanceId) -> InstanceSpec:
        c = self.cfg
        # Which launch this is: every call and push of the instance's carries it, so a given-up one is fenced.
        launch = {LAUNCH_ENV: str(self.coord.membership.members[inst].launches)}
        argv = instance_argv(
            inst.role,
            self.master_address,
            inst.index,
            self.locate(c.model_def),
            c.num_ps,
            c.seed,
            c.minibatch_size,
            strategy=c.strategy,
            global_batch=c.global_batch,
            weight_column=self.train.weight_column,
            skip_non_finite=c.skip_non_finite and inst.role == "worker",
            train_data=self.locate(self.train.uri) if self.model_def.takes_statistics else "",
        )
        # TensorFlow's pools: one thread each for a local shard; a worker's intra-op threads from worker_threads,
        # else the automatic rule, and its inter-op threads by its step's weight (master/threads.py, which says why).
        pools = pools_env(inst.role, self.plan.backend == "local", self._worker_intra_op(), self._worker_inter_op())
        if inst.role == "worker":
            return InstanceSpec(
                inst,
                argv,
                # its own faults (tests: a slow worker); its logs' format, its master's
                env={**launch, **pools, **self.faults.instance_env(inst), **logs.instance_env()},
                cpu=c.worker_cpu,
                memory=c.worker_memory,
                priority_class=c.worker_priority_class,
            )
        return InstanceSpec(
            inst,
            argv,
            env={**launch, **pools, **logs.instance_env()},
            cpu=c.ps_cpu or None,
            memory=c.ps_memory or None,
            priority_class=c.ps_priority_class,
        )

    def _worker_intra_op(self) -> int | None:
        c = self.cfg
        cores = usable_cpus()
        return worker_intra_op(c.worker_threads, self.plan.backend, c.strategy, c.max_workers, cores, c.worker_cpu)

    def _worker_inter_op(self) -> int | None:
        return worker_inter_op(self._worker_intra_op(), self.plan.backend == "local", self._minibatch_multiply_adds())

    def _minibatch_multiply_adds(self) -> int:
        """The step's weight, for its inter-op threads: the model's multiply-adds a minibatch (threads.py),
        counted once, on the local backend only."""
        if self._multiply_adds is None:
            self._multiply_adds = 0
            if self.plan.backend == "local":
                try:
                    self._multiply_adds = multiply_adds(self.model_def.model()) * self.cfg.minibatch_size
                except Exception as e:  # noqa: BLE001 - the user's error, reported as theirs where a model trains
                    log.debug("the model's multiply-adds not counted: its model() failed: %s", e)
        return self._multiply_adds

    def _launch(self, inst: InstanceId, relaunch: bool = False) -> None:
        self.coord.membership.launched(inst, relaunch)
        self.backend.start(self._spec(inst))

    def locate(self, uri: str) -> str:
        """A URI as instances open it: a local file's URL when the master serves it."""
        return self._input_server.url(uri) if self._input_server else uri

    def _serve_local_inputs(self, host: str) -> None:
        """Instances that do not share this step's filesystem (pods) read its local inputs (the
        prepared data and model file a pipeline hands the step as files) from the master."""
        c, local = self.cfg, []
        if local_path(c.train_data) is not None:
            local.append("training data")
        if c.model_def.endswith(".py") and local_path(c.model_def) is not None:
            local.append("model file")
        if self.backend.shares_files or not local:
            return
        self._input_server = InputServer(host).start(self.backend.master_address)
        log.info(
            "the %s: local to this step, so the job's pods read it from the master (HTTP, port %d)",
            " and ".join(local),
            self._input_server.port,
        )

    # ------------------------------------------------------------------ main loop
    def run(self) -> dict:
        """The step's life: start (serve the instances, launch them), pump until training is over, end (pull
        the model, evaluate and save it). Whatever ends with the job stops on one stack, whatever happened."""
        server = self._serve()
        self._log_plan()
        with self._teardown(server):
            self._train()
            with self._busy("pulling the trained model", "finishing"):
                if self.curve is not None:
                    self.curve.stop()
                model, ps_stats, evidence = self._final_model()
        with self._busy("evaluating and saving the model", "finishing"):
            return self._finish(model, ps_stats, evidence)

    def _serve(self):
        """The master's service, served where the instances reach it, and the step's local inputs for pods."""
        cfg, plan = self.cfg, self.plan
        service = MasterService(
            self.coord,
            plan.token,
            plan.job_id,
            cfg.minibatch_size,
            cfg.model_def,
            cfg.max_workers,
            cfg.pushes_in_flight,
            cfg.minibatches_per_push,
            failures=self.failures,
            skipped=self.skipped,
            checkpoint_state=lambda: self.durable.member_state,  # allreduce, resumed
            locate=self.locate,
            observed=self.observed,
        )
        host = "127.0.0.1" if plan.backend == "local" else "0.0.0.0"
        server, port = serve(service, host=host)
        self.master_address = self.backend.master_address(port)
        self._serve_local_inputs(host)
        return server

    def _teardown(self, server) -> contextlib.ExitStack:
        """What stops when the job ends, last started first stopped. SIGTERM (the step's pod is being deleted)
        from now on cuts a last checkpoint, then stops our instances (the pump)."""
        stack = contextlib.ExitStack()
        stack.callback(phases.dump, "master")
        if threading.current_thread() is threading.main_thread():
            stack.callback(signal.signal, signal.SIGTERM, signal.getsignal(signal.SIGTERM))
            signal.signal(signal.SIGTERM, lambda *_: setattr(self, "terminated_at", time.time()))
        if self._input_server is not None:
            stack.callback(self._input_server.stop)
        stack.callback(server.stop, grace=1)
        stack.callback(self.faults.close)
        stack.callback(self.backend.close, grace_s=10.0)
        stack.callback(self.coord.stop_all.set)
        stack.callback(self.durable.close)
        stack.callback(self.gray.close)
        if self.curve is not None:
            stack.callback(self.curve.close)
        return stack

    def _log_plan(self) -> None:
        cfg, plan = self.cfg, self.plan
        log.info(
            "job %s: %d records/epoch in %d tasks of <= %d records%s, %d epoch(s); %d PS, "
            "%d-%d workers on the %s backend",
            plan.job_id,
            self.ledger.records_per_epoch,
            len(self.ledger.queue),
            self.ledger.records_per_task,
            ""
            if cfg.records_per_task
            else f" (--records-per-task 0: {AUTO_MINIBATCHES_PER_TASK} minibatches, fewer for "
            f"{AUTO_MIN_TASKS_PER_EPOCH} tasks an epoch)",
            cfg.epochs,
            cfg.num_ps,
            cfg.min_workers,
            cfg.max_workers,
            plan.backend,
        )
        threads, inter = self._worker_intra_op(), self._worker_inter_op()
        log.info(
            "each worker's TensorFlow: %s intra-op threads%s, %s inter-op threads%s",
            threads or "the default",
            f" (--worker-threads {cfg.worker_threads})" if cfg.worker_threads else " (--worker-threads 0: automatic)",
            inter or "the default",
            f" (its step ~{self._minibatch_multiply_adds() / 1e6:.1f} M multiply-adds a minibatch; 2 from "
            f"{HEAVY_MINIBATCH / 1e6:.0f} M on 2 or more intra-op threads)"
            if inter
            else "",
        )

    def _train(self) -> None:
        """Launch the instances, open the shards, and pump until training is over; a failure is raised."""
        t_start = time.time()
        # Workers start with the shards, not after them: their start-up (TensorFlow's import, the
        # model's build) overlaps the shards'. The master withholds the shards' addresses until
        # every shard is up and restored, so no worker pushes before then.
        for i in range(0 if self.allreduce else self.cfg.num_ps):  # allreduce: no parameter servers
            self._launch(InstanceId("ps", i))
        for i in range(self.cfg.max_workers):
            self._launch(InstanceId("worker", i))
        if self.curve is not None:
            self.curve.prepare()  # while they start
        self.gray.start()
        if not self.allreduce:
            self._open_shards()
        with phases.span("master: training, from the shards' opening to the last commit"):
            self._pump(until=self.coord.finished.is_set)
        self.train_seconds = time.time() - t_start
        if self.failures.failure:
            raise self._failure()
        committed = self.ledger.records_committed_total()
        self.notices.finished(
            f"{committed} records committed in {self.cfg.epochs} epoch(s), {self.train_seconds:.0f} s; "
            + goodput.describe(self.goodput.figures(committed, self.ledger.trained_again))
        )
        self.progress.show(self.coord.sample(self.progress.rate(self.ledger.records_committed_total())), final=True)

    def _open_shards(self) -> None:
        """ps: once every shard is up, a first checkpoint (or a resumed job's restore), then workers may push."""
        self._pump(until=self.coord.ps_ready.is_set)
        if self.coord.ps_ready.is_set():  # else a shard failed: the job fails after the pump
            with self._busy("opening the parameter servers (a first checkpoint, or a restore)", "startup"):
                self.durable.shards_ready()
                if self.curve is not None and not self.eval_history:  # it starts at the initial weights
                    self.curve.initial_point()  # pulled now: once the shards are open, workers push at once
        self.coord.open_shards()

    def _pump(self, until) -> None:
        """Handle backend events and show progress until `until()` holds or the job fails."""
        last_tick = 0.0
        while not until() and self.failures.failure is None:
            self.health.turned()
            self.goodput.now_doing(self._doing(), *self.coord.worker_counts())
            self.notices.tick()
            # A checkpoint's barrier holds every worker: look for it reached every few milliseconds rather
            # than once a turn, which held them ~0.1 s a checkpoint.
            for ev in self.backend.events(timeout=BARRIER_POLL_S if self.durable.cutting else PUMP_TURN_S):
                self._on_event(ev)
            now = time.time()
            committed = self.ledger.records_committed_total()
            fault_hooks.PUMP_TURN(committed)
            if self.terminated_at is not None:
                with self._busy("cutting a last checkpoint", "checkpoint"):
                    last = self.durable.last_cut(committed, now)
                if last:
                    self.failures.report("master", "terminated", "the master received SIGTERM", "")
                continue
            # Events in the order of the records they wait for: a cut due at fewer records than a fault is
            # cut before the fault fires, even when one turn of a busy pump sees the records pass both.
            # A checkpoint is written in a turn that began with its barrier up: that turn may take long.
            with self._busy("cutting a checkpoint", "checkpoint") if self.durable.cutting else contextlib.nullcontext():
                self.durable.tick(committed, now)
            if not self.durable.cutting:
                self.faults.tick(committed, self.backend, self.coord)
            if (
                self.curve is not None and self.ledger.awaiting_evaluation
            ):  # early stopping: the epoch waits for its point
                self.curve.held(self.ledger.epoch)
            elif self.curve is not None and not self.ledger.done:  # a point for an epoch just ended, within budget
                self.curve.tick(self.ledger.epoch, now)
            self.gray.tick(time.time(), evaluating=self.curve is not None and self.curve.computing())
            if now - last_tick >= 0.5:
                last_tick = now
                sample = self.coord.sample(self.progress.rate(committed, now))
                self.progress.show(sample)
                self.tensorboard.progress(sample)

    def _doing(self) -> str:
        """What the master does this turn, as goodput counts it (master/observe/goodput.py). The eval curve's points
        run beside training, within their share of it: they show as slower training, not as time of their own."""
        coord = self.coord
        if self.durable.cutting or coord.holding:
            return "checkpoint"
        if coord.rewinding:
            return "restore"
        if coord.pace.first_commit_at is None:
            return "startup"
        return "waiting" if coord.membership.training_count() == 0 else goodput.TRAINING

    def _on_event(self, ev) -> None:
        ev = self.gray.on_end(ev)
        remainder = self.coord.on_instance_event(ev)
        if ev.kind == EventKind.WAITING:  # below strength, and why: the platform's queue or scheduler
            log.warning("%s is waiting: %s", ev.instance, ev.detail)
        if ev.kind not in (EventKind.EXITED, EventKind.LOST):
            return
        over = self.coord.finished.is_set()
        member = self.coord.membership.members[ev.instance]
        report = self.failures.take(str(ev.instance))
        decision = self.relaunch.on_end(
            ev,
            over,
            self.failures.failure is not None,
            member.crashes_without_progress,
            checkpoint=self.durable.can_restore(),
            report=report,
        )
        if decision.action == "none":
            return
        cause = {"cause": loss_cause(ev)} if ev.instance.role == "worker" else {}
        if cause:
            self.coord.count_worker_loss(cause["cause"])
        log.info(
            "decision: %s — %s%s",
            decision.action,
            decision.reason,
            f"; remainder [{remainder[0]}, {remainder[1]}) requeued" if remainder else "",
            extra={"event": "decision"},
        )
        self.timeline.record("decision", str(ev.instance), f"{decision.action}: {decision.reason}", **cause)
        if decision.action == "relaunch":
            self.coord.mark_replacement(ev.instance, ev.time)
            self._launch(ev.instance, relaunch=True)
        elif decision.action == "restore":
            self._restore_after_ps_loss(ev.instance, ev.time)
        elif decision.action == "fail" and self.failures.failure is None:
            # The error whole, as the instance reported it; else what its log ends with.
            tail = report["traceback"] if report else self._log_tail(ev.instance)
            minibatch = report["minibatch"] if report else ""
            kind = "same_error" if report else "instance_failed"
            self.failures.report(str(ev.instance), kind, decision.reason, tail, minibatch)

    def _restore_after_ps_loss(self, inst: InstanceId, lost_at: float) -> None:
        """Every shard and the ledger back to the last checkpoint, one cut (restoring the lost shard
        alone would leave the others holding updates it lost). The lost shard is relaunched and
        restored, the others restored in place, as a new generation: workers stay up, learn it from
        their next push (refused) and register again for the shards."""
        with self._busy("rewinding to the last checkpoint", "restore"):
            manifest, generation = self.durable.rewind(inst.index, lost_at)
        self._launch(inst, relaunch=True)
        self._pump(until=self.coord.ps_ready.is_set)
        if self.failures.failure is None:
            with self._busy("restoring the parameter servers from the last checkpoint", "restore"):
                self.durable.restore_shards(manifest, generation)
            self.durable.rewound(generation)

    def _log_tail(self, inst: InstanceId, lines: int = 15) -> str:
        path = getattr(self.backend, "log_path", lambda _i: None)(inst)
        try:
            return "".join(open(path, errors="replace").readlines()[-lines:]) if path else ""
        except OSError:
            return ""

    def _failure(self) -> ElasticStepError:
        f = self.failures.failure
        where = f" ({f['instance']})" if f.get("instance") else ""
        self.notices.failed(f"{f['kind']}{where}: {f['message']}")
        self.tensorboard.close()
        self._write_summary(status="failed", error=f)
        if f["kind"] == "terminated":
            return StepTerminated(
                "The training step was terminated (SIGTERM) before it finished; all its "
                f"workers and parameter servers were stopped. {self.durable.resume_note()}"
            )
        detail = f["message"]
        if f["kind"] == "instance_failed" and f.get("traceback"):
            detail += "\nLast lines of its log:\n" + f["traceback"]
        elif f["kind"] == "same_error" and f.get("traceback"):
            detail += "\nIts traceback:\n" + f["traceback"].rstrip()
        # A worker's refusal of a state that does not fit the model (a changed model) is bad input, as the same
        # refusal by a PS shard's restore is (master/durability/checkpoint.py): the same exit code in both strategies.
        return (ConfigError if f["kind"] == "config_error" else JobFailed)(f"Training failed{where}: {detail}")

    # ------------------------------------------------------------------ the end
    def _load_from_ps(self, model, with_stats: bool = False, final: bool = False) -> list:
        """Load the parameter servers' current weights and state into a model built from the model definition;
        with `with_stats`, return each shard's Stats (counters and the audit's evidence). `final`: the
        values a finished training leaves (the optimizer's moving averages when it keeps them)."""
        from elastic_step.ps.api import Placement
        from elastic_step.ps.client import PSClient, load_shards

        ps = PSClient(self.coord.ps_addresses, self.plan.token, Placement.of(model, self.cfg.num_ps))
        try:
            load_shards(ps, model, final_averages=final and self.model_def.optimizer().use_ema)
            return ps.stats() if with_stats else []
        finally:
            ps.close()

    def _final_model(self):
        import keras

        from elastic_step.proto import tensors

        keras.utils.set_random_seed(self.cfg.seed)
        model = self.model_def.model()
        if self.allreduce:
            stats, evidence = None, [self._load_from_rank0(model, final=True)]
        else:
            stats = self._load_from_ps(model, with_stats=True, final=True)
            evidence = [tensors.decode_applied(s.applied) for s in stats]
        if self.early_stop is not None and self.early_stop.best_weights is not None:
            # As EarlyStopping(restore_best_weights=True) leaves the model: the best epoch's weights. The evidence
            # is still the last epoch's: the audit is of what training applied.
            model.set_weights(self.early_stop.best_weights)
        return model, stats, evidence

    def _load_from_rank0(self, model, final: bool = False) -> dict:
        """allreduce: the members' weights (identical on every member), from the first that answers, the one
        heard from last asked first.
        `final`: the state of the last committed step, finalized as `fit` leaves a model (with use_ema, the
        moving averages); else that of the last committed step or a later one (an epoch's point: never a state
        before the epoch's end, which a member serves until it hears the commit). Returns
        the records those weights hold, as the member accounted them (the audit's evidence)."""
        from elastic_step.instance.collective_client import pull_state, pull_state_since

        def load(num_model, values):
            for var, value in zip(model.weights, values[:num_model]):
                var.assign(value.reshape(tuple(var.shape)))
            if final:  # with use_ema, the moving averages the members' optimizer state holds
                finalize(model, self.model_def.optimizer(), values[num_model:])

        rdv = self.coord.rendezvous
        with self.coord.lock:
            members, step, restoring = list(rdv.members), rdv.committed_step, rdv.restore_checkpoint
            # The member heard from last first: one that has said nothing since the others' last step may be
            # frozen, and a pull from it would hold an epoch's evaluation (which holds the hang clocks) for its
            # timeout. Every member holds the same weights.
            heard = self.coord.membership.members
            members.sort(key=lambda m: -getattr(heard.get(InstanceId.parse(m[0])), "last_seen", 0.0))
        if restoring and self.durable.member_state is not None:
            # No step committed since a checkpoint was restored: its state is the model (members may not
            # have loaded it yet).
            state = self.durable.member_state
            load(state.num_model, state.values)
            return state.applied
        errors = []
        # An epoch's evaluation holds the hang clocks: a frozen member asked first holds it no longer than the
        # shortest hang bound (--hang-timeout; the final pull waits the usual 30 s on each).
        timeout = 30.0 if final else min(30.0, self.bounds.least)
        for name, address in members:
            try:
                pull = pull_state if final else pull_state_since
                state = pull(address, self.plan.token, step, timeout=timeout)
            except Exception as e:  # noqa: BLE001 - try the next member
                errors.append(f"{name}: {e}")
                continue
            load(state.num_model, state.values)
            return state.applied
        raise ElasticStepError("could not pull the trained weights from any allreduce member: " + "; ".join(errors))

    def _finish(self, model, ps_stats, evidence) -> dict:
        from elastic_step.evaluation import evaluate
        from elastic_step.model_io import save_model

        with self.goodput.doing("evaluation"):
            metrics = evaluate(model, self.model_def, self.eval) if self.eval else {}
        self.tensorboard.evaluation({"epoch": self.ledger.epochs - 1, **metrics})  # the curve's last point
        self.tensorboard.close()
        outputs = save_model(model, str(self.output))
        outputs["report"] = str(self.output / REPORT_FILE)
        outputs = {
            k: self.plan.output_uri.rstrip("/") + "/" + os.path.relpath(v, self.plan.output) for k, v in outputs.items()
        }
        extra = {"audit": self._audit(evidence), **({"ps": [ps_summary(s) for s in ps_stats]} if ps_stats else {})}
        if self.early_stop is not None:
            extra["early_stop"] = self.early_stop.summary(self.ledger.epochs)
        summary = self._write_summary(status="succeeded", eval=metrics, outputs=outputs, **extra)
        self.durable.finished()
        log.info(
            "job %s succeeded: %s; %s",
            self.plan.job_id,
            ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float)),
            goodput.describe(summary["goodput"]),
            extra={"event": "finished"},
        )
        return summary

    def _audit(self, evidence: list[dict]) -> dict:
        """What the PS shards (or the allreduce member whose weights are the model) say they applied,
        laid over the training data, not over the ledger: see master/durability/audit.py."""
        result = audit(
            [s.rows for s in self.train.shards],
            self.ledger.epochs,  # the epochs that ran: fewer than configured when early stopping ended training
            evidence,
            source="allreduce" if self.allreduce else "ps",
        )
        (log.info if result["verdict"] == EXACT else log.error)("%s", describe(result))
        return result

    def _write_summary(self, status: str, **extra) -> dict:
        c, coord, t0 = self.cfg, self.coord, self.timeline.t0
        rdv_summary = self.coord.rendezvous.summary() if self.coord.rendezvous else None
        chaos_summary = self.faults.summary()
        with coord.lock:
            committed = self.ledger.records_committed_total()
            spent = [round(x, 3) for x in coord.pace.spent_total()]
            summary = {
                "status": status,
                "job_id": self.plan.job_id,
                "strategy": c.strategy,
                "backend": self.plan.backend,
                "records_per_epoch": self.ledger.records_per_epoch,
                "epochs": c.epochs,
                "epochs_ran": min(self.ledger.epoch, self.ledger.epochs),
                "config": {
                    "minibatch_size": c.minibatch_size,
                    "records_per_task": self.ledger.records_per_task,
                    "min_workers": c.min_workers,
                    "max_workers": c.max_workers,
                    "num_ps": c.num_ps,
                    # a worker's TensorFlow intra-op threads as given (0: automatic), and its pools as the job ran
                    # them (None: TensorFlow's own default)
                    "worker_threads": c.worker_threads,
                    "worker_intra_op_threads": self._worker_intra_op(),
                    "worker_inter_op_threads": self._worker_inter_op(),
                    "model_def": c.model_def,
                    "train_data": c.train_data,
                    "eval_data": c.eval_data,
                },
                "ledger": {
                    "epochs": [a.as_dict() for a in self.ledger.accounts],
                    "records_committed": committed,
                    "duplicate_pushes_suppressed": coord.duplicates_suppressed,
                    "records_trained_again": self.ledger.trained_again,
                },
                # the workers' own time computing their steps and waiting (on the shards, or in the ring)
                "workers": {**coord.membership.summary(), **dict(zip(("step_s", "wait_s"), spent))},
                "recovery": {
                    "requeue_latency_s": [round(x, 4) for x in self.ledger.requeue_latencies],
                    "first_commit_after_loss_s": [round(x, 3) for x in coord.pace.recovery_first_commit_s],
                    **(
                        {k: rdv_summary.pop(k) for k in ("loss_to_next_commit_s", "join_to_first_commit_s")}
                        if rdv_summary
                        else {}
                    ),
                },
                **({"allreduce": {**rdv_summary, "global_batch": c.global_batch}} if rdv_summary else {}),
                "training_seconds": round(self.train_seconds, 3),
                "startup_seconds": round((coord.pace.first_commit_at or time.time()) - t0, 3),
                "throughput_records_per_s": round(coord.throughput(), 1),
                "goodput": self.goodput.figures(committed, self.ledger.trained_again),
                "eval": {k: v for k, v in extra.pop("eval", {}).items() if not hasattr(v, "shape")},
                "eval_history": list(self.eval_history),
                "timeseries": list(coord.pace.samples),
                "workers_alive": [
                    {"t": round(t - self.timeline.t0, 3), "alive": n} for t, n in coord.membership.alive_samples
                ],
                "events": list(self.timeline.events),
                "fencing": coord.fences.summary(),
                **({"skipped_non_finite": self.skipped.summary()} if c.skip_non_finite or self.skipped.skipped else {}),
                **({"chaos": chaos_summary} if chaos_summary else {}),
                "checkpoints": {"root": self.plan.checkpoint_root, **self.durable.summary()},
            }
        summary.update(extra)
        write_json(str(self.output / SUMMARY_FILE), summary)
        write_report(summary, str(self.output / REPORT_FILE))
        return summary


def ps_summary(stats) -> dict:
    """A PS shard's counters for summary.json."""
    from elastic_step.proto import tensors

    return {
        "shard": stats.shard,
        "pushes_applied": stats.pushes_applied,
        "pushes_skipped": stats.pushes_skipped,
        "pushes_fenced": stats.pushes_fenced,  # refused: a fenced worker launch's (master/gray/fence.py)
        "dense_parameters": stats.dense_parameters,
        "embedding_rows_touched": {t.name: int(tensors.decode(t.ids).size) for t in stats.touched},
        "embedding_ids_sample": {t.name: tensors.decode(t.ids)[:20].tolist() for t in stats.touched},
    }


def train(cfg: TrainConfig) -> dict:
    """Run a whole training job; returns the summary (also written to OUTPUT/summary.json).

    An output in an object store (gs://, s3://) is checked writable before anything starts, written in a
    local staging folder, and uploaded at the end, summary.json last: a reader that finds the summary
    finds the model, report and logs it names. Checkpoints go straight to OUTPUT/checkpoints/<job id> there."""
    if local_path(cfg.output) is not None:
        try:
            os.makedirs(local_path(cfg.output), exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"Cannot create the training step's output folder {cfg.output}: {e.strerror}. "
                "Pass an --output the step may write to (a local folder, gs:// or s3://)."
            ) from None
    check_writable(cfg.output, "write the training step's output to", ConfigError)
    from elastic_step.backends.kubernetes.config import in_cluster, master_host

    in_pod = in_cluster()
    checked(cfg)
    if cfg.backend == "local" or (cfg.backend == "auto" and not in_pod):
        # Before the health endpoint's thread: the instances' preloader forked from this process, which imports
        # TensorFlow anyway, instead of a second interpreter importing it (backends/preloaded.py).
        fork_preloader()
    # Served from here to the step's end (the upload too): a probe that finds no endpoint counts a failure. In a
    # pod, on the pod's IP, where the kubelet's probe asks (and a mesh's rewritten probe too).
    metrics = JobMetrics()
    with serving(cfg.health_port, in_pod, master_host(in_pod), metrics.render) as health:
        if local_path(cfg.output) is not None:
            return TrainingJob(cfg, health=health, metrics=metrics).run()
        staging = tempfile.mkdtemp(prefix="elastic-step-output-")
        try:
            summary = TrainingJob(cfg, staging=staging, health=health, metrics=metrics).run()
        except BaseException:
            with health.busy("uploading the failed step's output"):
                _upload(staging, cfg.output, failed=True)  # a failed job's summary, report and logs
            raise
        with health.busy("uploading the output"):
            _upload(staging, cfg.output)
        return summary


def _upload(staging: str, uri: str, failed: bool = False) -> None:
    log.info("uploading the output to %s", uri)
    try:
        copy_folder(staging, uri, last=SUMMARY_FILE)
    except Exception as e:  # noqa: BLE001 - the store failed at the end: one clear paragraph
        if not failed:  # else the job's own error is the one to report
            raise ConfigError(explain(uri, e, "upload the training step's output to")) from None
        log.error("%s", explain(uri, e, "upload the failed step's output to"))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
