"""How an instance's process starts, before its role's first line of work: it reads the command line the master
gave it (api.py), dies with the master on the local backend, and logs as its role and index."""

from __future__ import annotations

import argparse
import logging

from elastic_step.instance.api import parse_args
from elastic_step.util import logs
from elastic_step.util.process import die_with_parent


def start(role: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments of this `role`'s process (`python -m elastic_step.<role>`), once it is set up to run."""
    args = parse_args(role, argv)
    die_with_parent()
    log_format, job = logs.instance_format()
    logs.configure(
        log_format,
        logging.INFO,
        f"%(asctime)s {role}-{args.index} %(levelname)s %(message)s",
        f"{role}-{args.index}",
        job,
    )
    return args
