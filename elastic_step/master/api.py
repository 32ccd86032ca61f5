"""Master contract: the parameters of a training job, and the rules each one keeps by itself.

Only types and their own checks here: what needs an implementation to check (the checkpoint interval's parser,
the pods' settings) is checked where the job's plan is made (master/plan.py `checked`)."""

from __future__ import annotations

import dataclasses

from elastic_step.errors import ConfigError
from elastic_step.spec import BY_NAME
from elastic_step.spec import DEFAULTS as _D

STRATEGIES = BY_NAME["strategy"].choices
GLOBAL_BATCH = BY_NAME["global_batch"].choices
BACKENDS = BY_NAME["backend"].choices
MAX_PUSHES_IN_FLIGHT = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What the user asked for, as given: immutable. What the master decides from it at start (the job id
    when none is given, the backend --backend auto picks, the token, the checkpoint root) is its plan
    (master/plan.py). The fields and their defaults are the spec's training parameters (elastic_step/spec.py,
    where each one's meaning is; a test keeps the two the same)."""

    model_def: str
    train_data: str
    eval_data: str | None = _D["eval_data"]
    output: str
    epochs: int = _D["epochs"]
    minibatch_size: int = _D["minibatch_size"]
    records_per_task: int = _D["records_per_task"]
    min_workers: int = _D["min_workers"]
    max_workers: int = _D["max_workers"]
    num_ps: int = _D["num_ps"]
    backend: str = _D["backend"]  # auto | local | kubernetes (auto: see master/job.py make_backend)
    strategy: str = _D["strategy"]
    global_batch: str = _D["global_batch"]  # allreduce: "scaled" (lr follows world size) or "fixed"
    seed: int = _D["seed"]
    skip_non_finite: bool = _D["skip_non_finite"]  # skip a minibatch whose loss or gradient is not finite
    early_stop_metric: str = _D["early_stop_metric"]  # empty: no early stopping (master/early_stop.py)
    early_stop_patience: int = _D["early_stop_patience"]
    early_stop_min_delta: float = _D["early_stop_min_delta"]
    pushes_in_flight: int = _D["pushes_in_flight"]
    minibatches_per_push: int = _D["minibatches_per_push"]
    worker_threads: int = _D["worker_threads"]  # 0: automatic (master/threads.py)
    job_id: str = _D["job_id"]  # empty: the plan makes one up
    worker_image: str = _D["worker_image"]
    worker_cpu: str = _D["worker_cpu"]  # empty: no request
    worker_memory: str = _D["worker_memory"]
    worker_priority_class: str = _D["worker_priority_class"]
    ps_priority_class: str = _D["ps_priority_class"]
    queue: str = _D["queue"]  # a Kueue LocalQueue (backends/kubernetes/kueue.py)
    pending_report: float = _D["pending_report"]  # seconds; 0: never (backends/kubernetes/pending.py)
    # what dresses the pods of each role (backends/kubernetes/settings.py)
    ps_cpu: str = _D["ps_cpu"]
    ps_memory: str = _D["ps_memory"]
    worker_accelerators: str = _D["worker_accelerators"]
    ps_accelerators: str = _D["ps_accelerators"]
    worker_tolerations: str = _D["worker_tolerations"]
    ps_tolerations: str = _D["ps_tolerations"]
    worker_node_selector: str = _D["worker_node_selector"]
    ps_node_selector: str = _D["ps_node_selector"]
    worker_affinity: str = _D["worker_affinity"]
    ps_affinity: str = _D["ps_affinity"]
    job_service_account: str = _D["job_service_account"]
    env: str = _D["env"]
    env_from_secrets: str = _D["env_from_secrets"]
    volumes: str = _D["volumes"]
    spot_nodes: str = _D["spot_nodes"]
    max_relaunches: int = _D["max_relaunches"]  # per job: a crash loop fails the job instead of spinning
    health_port: int = _D["health_port"]  # -1: 8080 in a pod, else none; 0: none (master/health.py)
    hang_timeout: float = _D["hang_timeout"]  # seconds; 0: the measured bound (master/gray/hang.py)
    progress: str = _D["progress"]
    checkpoint_every: str = _D["checkpoint_every"]  # a time (60s, 5m) or records (50000); 0: no checkpoints
    # <checkpoint_uri>/<job id>/ (any fsspec URI); empty: <output>/checkpoints/<job id>/ (master/plan.py)
    checkpoint_uri: str = _D["checkpoint_uri"]
    resume: str = _D["resume"]  # auto: from this job's last checkpoint when there is one | never
    # Fault injection for tests and benchmarks, e.g. kill a worker after N committed records (see
    # faults/chaos.py). None given: the job reads ELASTIC_STEP_CHAOS at its start.
    chaos: tuple[str, ...] = ()

    def validate(self) -> TrainConfig:
        """Each parameter by its own rules; master/plan.py `checked` adds those that need what reads them."""

        def positive(name: str) -> None:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")

        for name in (
            "epochs",
            "minibatch_size",
            "min_workers",
            "max_workers",
            "num_ps",
            "pushes_in_flight",
            "minibatches_per_push",
        ):
            positive(name)
        if self.records_per_task < 0:
            raise ConfigError(
                f"--records-per-task must be >= 0 (0: 32 minibatches a task, fewer for a small epoch), "
                f"got {self.records_per_task}."
            )
        if self.worker_threads < 0:
            raise ConfigError(
                "--worker-threads must be >= 0 (0: automatic, from the cores and the workers), "
                f"got {self.worker_threads}."
            )
        if not self.hang_timeout >= 0:  # NaN too
            raise ConfigError(
                f"--hang-timeout must be a number of seconds >= 0 (0: measured from each worker's pace), "
                f"got {self.hang_timeout}."
            )
        if not self.pending_report >= 0:  # NaN too
            raise ConfigError(
                f"--pending-report must be a number of seconds >= 0 (0: never report a pending pod), "
                f"got {self.pending_report}."
            )
        if self.pushes_in_flight > MAX_PUSHES_IN_FLIGHT:
            raise ConfigError(
                f"--pushes-in-flight {self.pushes_in_flight} is more than {MAX_PUSHES_IN_FLIGHT}: "
                "each one adds an update of staleness to every gradient and gains no speed "
                f"past the worker's and the PS's overlap. Use 1 (the default) or 2."
            )
        if self.minibatches_per_push > 1 and self.strategy != "ps":
            raise ConfigError(
                f"--minibatches-per-push {self.minibatches_per_push} is for --strategy ps; "
                "with allreduce, --global-batch fixed accumulates minibatches instead."
            )
        if self.early_stop_metric and not self.eval_data:
            raise ConfigError(
                f"--early-stop-metric {self.early_stop_metric!r} needs the per-epoch evaluation: pass --eval-data "
                "(or --prepared with an eval split), or leave --early-stop-metric empty."
            )
        if self.early_stop_patience < 0 or not self.early_stop_min_delta >= 0:  # NaN too
            raise ConfigError(
                f"--early-stop-patience ({self.early_stop_patience}) and --early-stop-min-delta "
                f"({self.early_stop_min_delta}) must be >= 0."
            )
        if self.min_workers > self.max_workers:
            raise ConfigError(
                f"--min-workers ({self.min_workers}) is larger than --max-workers "
                f"({self.max_workers}); the job could never start training."
            )
        if self.backend not in BACKENDS:
            raise ConfigError(f"Unknown --backend {self.backend!r}; choose one of {', '.join(BACKENDS)}.")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"Unknown --strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}.")
        if self.global_batch not in GLOBAL_BATCH:
            raise ConfigError(f"Unknown --global-batch {self.global_batch!r}; choose one of {', '.join(GLOBAL_BATCH)}.")
        if self.resume not in BY_NAME["resume"].choices:
            raise ConfigError(f"Unknown --resume {self.resume!r}; choose auto or never.")
        if not -1 <= self.health_port <= 65535:
            raise ConfigError(
                "--health-port must be a TCP port, 0 (no health endpoint) or -1 (8080 in a pod), "
                f"got {self.health_port}."
            )
        if self.progress not in BY_NAME["progress"].choices:
            raise ConfigError(f"Unknown progress mode {self.progress!r}.")
        return self
