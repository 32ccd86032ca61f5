"""Master contract: the validated parameters of a training job and the job's outcome."""
from __future__ import annotations

import dataclasses
import secrets
import uuid

from elastic_step.errors import ConfigError

STRATEGIES = ("ps", "allreduce")
GLOBAL_BATCH = ("scaled", "fixed")
BACKENDS = ("auto", "local", "kubernetes")
MAX_PUSHES_IN_FLIGHT = 4


@dataclasses.dataclass
class TrainConfig:
    model_def: str
    train_data: str
    eval_data: str | None
    output: str
    epochs: int = 1
    minibatch_size: int = 64
    records_per_task: int = 512
    min_workers: int = 1
    max_workers: int = 2
    num_ps: int = 1
    backend: str = "auto"                # auto | local | kubernetes (auto: see master/job.py make_backend)
    strategy: str = "ps"
    global_batch: str = "scaled"       # allreduce: "scaled" (lr follows world size) or "fixed" (accumulation)
    seed: int = 0
    # ps: pushes each worker keeps in flight. One is the algorithm fit runs when the job has one worker;
    # two overlap a worker's step with the PS's update (faster), at one more update of staleness.
    pushes_in_flight: int = 1
    # ps: minibatches whose mean gradient one push carries (Keras's gradient_accumulation_steps, done on
    # the worker): fewer round trips per record for a small model, fewer updates per epoch.
    minibatches_per_push: int = 1
    job_id: str = dataclasses.field(default_factory=lambda: "es-" + uuid.uuid4().hex[:8])
    token: str = dataclasses.field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    worker_cpu: str | None = None
    worker_memory: str | None = None
    worker_priority_class: str | None = None
    ps_priority_class: str | None = None
    image: str | None = None
    max_relaunches: int = 20           # per job: a crash loop fails the job instead of spinning
    progress: str = "auto"             # auto | bar | lines | off
    checkpoint_every: str = "60s"      # a time (60s, 5m) or records (50000); 0: no checkpoints
    # Where checkpoints go: <checkpoint_dir>/<job_id>/ (any fsspec URI), so that a retried step in a new
    # pod finds them; empty: <output>/checkpoints, which lasts only as long as the output does.
    checkpoint_dir: str = ""
    resume: str = "auto"               # auto: from this job's last checkpoint when there is one | never
    # Fault injection for tests and benchmarks, e.g. kill a worker after N committed records (see
    # faults/chaos.py). None given: the job reads ELASTIC_STEP_CHAOS at its start.
    chaos: tuple[str, ...] = ()

    def validate(self) -> "TrainConfig":
        def positive(name: str) -> None:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")
        for name in ("epochs", "minibatch_size", "records_per_task", "min_workers", "max_workers", "num_ps",
                     "pushes_in_flight", "minibatches_per_push"):
            positive(name)
        if self.pushes_in_flight > MAX_PUSHES_IN_FLIGHT:
            raise ConfigError(f"--pushes-in-flight {self.pushes_in_flight} is more than {MAX_PUSHES_IN_FLIGHT}: "
                              "each one adds an update of staleness to every gradient and gains no speed "
                              f"past the worker's and the PS's overlap. Use 1 (the default) or 2.")
        if self.minibatches_per_push > 1 and self.strategy != "ps":
            raise ConfigError(f"--minibatches-per-push {self.minibatches_per_push} is for --strategy ps; "
                              "with allreduce, --global-batch fixed accumulates minibatches instead.")
        if self.min_workers > self.max_workers:
            raise ConfigError(f"--min-workers ({self.min_workers}) is larger than --max-workers "
                              f"({self.max_workers}); the job could never start training.")
        if self.backend not in BACKENDS:
            raise ConfigError(f"Unknown --backend {self.backend!r}; choose one of {', '.join(BACKENDS)}.")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"Unknown --strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}.")
        if self.global_batch not in GLOBAL_BATCH:
            raise ConfigError(f"Unknown --global-batch {self.global_batch!r}; choose one of {', '.join(GLOBAL_BATCH)}.")
        if self.resume not in ("auto", "never"):
            raise ConfigError(f"Unknown --resume {self.resume!r}; choose auto or never.")
        from elastic_step.master.checkpoint_store import parse_interval
        parse_interval(self.checkpoint_every)
        if self.progress not in ("auto", "bar", "lines", "off"):
            raise ConfigError(f"Unknown progress mode {self.progress!r}.")
        return self
