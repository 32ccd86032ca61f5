"""What the master decides at the start of a job, once, from its immutable TrainConfig.

- the job id: the one given, else a new one;
- where the job writes (a local staging folder when the output is in an object store) and where its
  outputs end up;
- the checkpoint root: `<checkpoint_uri or OUTPUT/checkpoints>/<job id>/` in every case, so that a
  retried step with the same job id finds its checkpoints wherever they are kept;
- the backend actually used (--backend auto picks local or kubernetes) and the job's token, which the
  Kubernetes backend may take from a restarted job's Secret: both known once the backend is up.

Before any of it, the config is `checked`: each parameter by its own rules (TrainConfig.validate), then those
whose check is the parser that reads them, so that a bad value fails the step before anything starts.

The job, the backend and the summary read the plan; nothing writes the config back.
"""

from __future__ import annotations

import dataclasses
import secrets
import uuid

from elastic_step.backends.kubernetes.settings import PodSettings
from elastic_step.master.api import TrainConfig
from elastic_step.master.durability.store import parse_interval


def checked(cfg: TrainConfig) -> TrainConfig:
    """`cfg`, every parameter checked, or a ConfigError naming the first bad one and its fix."""
    cfg.validate()
    parse_interval(cfg.checkpoint_every)
    PodSettings.from_train_config(cfg)  # every pod setting parses, whatever the backend: before any pod
    return cfg


def new_job_id() -> str:
    return "es-" + uuid.uuid4().hex[:8]


def new_token() -> str:
    return secrets.token_urlsafe(24)


def checkpoint_root(checkpoint_uri: str, output: str, job_id: str) -> str:
    """The folder of a job's checkpoints: `<checkpoint_uri or OUTPUT/checkpoints>/<job id>`."""
    base = checkpoint_uri or f"{output.rstrip('/')}/checkpoints"
    return f"{base.rstrip('/')}/{job_id}"


@dataclasses.dataclass(frozen=True)
class JobPlan:
    job_id: str
    output: str  # where this job writes: the output, or a local staging folder for an object store
    output_uri: str  # where its outputs end up (uploaded from `output` at the end when they differ)
    checkpoint_root: str  # checkpoint_root() of the output the user gave
    backend: str  # the backend used: local or kubernetes
    token: str = dataclasses.field(repr=False)  # the secret every RPC of the job carries
