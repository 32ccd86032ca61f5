"""The step's logs: lines for a person (the default), or `--log-format json` for a log shipper: one JSON object a
line, with the job's id, the role that wrote it (master, worker-3, ps-0) and, for what the master decides, the
event's kind (`lost`, `hung`, `fenced`, `straggler`, `checkpoint`, `epoch_end`, `decision`, `finished`), as a log
call passes it (`extra={"event": kind}`). A job's instances log as their master does: it passes the format in their
environment (`instance_env`)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

FORMATS = ("text", "json")
FORMAT_ENV = "ELASTIC_STEP_LOG_FORMAT"  # an instance's: the format its master logs in
JOB_ENV = "ELASTIC_STEP_LOG_JOB"  # ... and the job's id, for its lines


class JsonLines(logging.Formatter):
    def __init__(self, job: str, role: str):
        super().__init__()
        self.job, self.role = job, role

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(),
            "level": record.levelname,
            "job": self.job,
            "role": self.role,
            "event": getattr(record, "event", ""),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(log_format: str, level: int, text: str, role: str, job: str = "", datefmt: str | None = None) -> None:
    """The process's logging on stderr: `text` (a logging format) for a person, or JSON lines of `job` and `role`."""
    if log_format not in FORMATS:
        raise ValueError(f"log format {log_format!r}: one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines(job, role) if log_format == "json" else logging.Formatter(text, datefmt))
    logging.basicConfig(level=level, handlers=[handler])
    if log_format == "json":
        os.environ[FORMAT_ENV], os.environ[JOB_ENV] = log_format, job  # the local instances inherit it


def instance_env() -> dict[str, str]:
    """What a job's instances need to log as this process does (pods do not inherit its environment)."""
    if os.environ.get(FORMAT_ENV) != "json":
        return {}
    return {FORMAT_ENV: "json", JOB_ENV: os.environ.get(JOB_ENV, "")}


def instance_format() -> tuple[str, str]:
    """(format, job id) an instance logs with, as its master passed them."""
    return os.environ.get(FORMAT_ENV) or "text", os.environ.get(JOB_ENV, "")
