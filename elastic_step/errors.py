"""Errors a user sees. Each carries one paragraph that names the thing and the fix.

The CLI prints `str(error)` and exits non-zero; it never shows a traceback for these.
"""

from __future__ import annotations

import os

# Where Kubernetes reads a container's termination message (the pod spec's default
# terminationMessagePath): it becomes the container status's message, which Argo shows as the
# failed step's message and KFP as the task's error.
TERMINATION_LOG = "/dev/termination-log"


class ElasticStepError(Exception):
    """Base of every user-facing error."""

    exit_code = 2


class ConfigError(ElasticStepError):
    """A parameter is out of range or inconsistent."""


class DataError(ElasticStepError):
    """Input data cannot be read, does not match its schema, or has a bad row."""


class ModelDefError(ElasticStepError):
    """The model definition module is missing, lacks a function, or a function raised."""


class JobFailed(ElasticStepError):
    """The training job failed; the message says which instance and why."""

    exit_code = 1


class StepTerminated(JobFailed):
    """The step's process got SIGTERM (its pod was preempted, evicted, drained or deleted) before the job
    finished. It exits 143 (128 + SIGTERM), as a process killed by the signal would, so that a retry
    policy can retry this and not a job that failed on its own (1) or bad input (2)."""

    exit_code = 143


def write_termination_message(message: str, path: str | None = None) -> None:
    """Leave ``message`` where Kubernetes reads it, when this process runs in a container that has
    one; elsewhere (a laptop, kfp.local) nothing is written. Kubernetes keeps at most 4096 bytes."""
    path = path or TERMINATION_LOG
    if not os.path.isfile(path):
        return
    try:
        with open(path, "w") as f:
            f.write(message.encode()[:4096].decode(errors="ignore"))
    except OSError:
        pass
