"""The contract between the master and its instances (a worker or a PS shard): the command line the master
starts one with and how the instance reads it, the environment it is given, and the exit codes and refusal by
which it ends.

The backend starts `python -m elastic_step.worker|ps --master ADDR --index I ...`; the job token
comes from the environment (ELASTIC_STEP_TOKEN: a Secret on Kubernetes), never the command line.
"""

from __future__ import annotations

import argparse
import os
import sys

TOKEN_ENV = "ELASTIC_STEP_TOKEN"
# Exit code of an instance that failed through the user's model or data: the master does not
# relaunch it, it fails the job with the reported error.
EXIT_USER_ERROR = 3
# Which launch of its role-index an instance is (1, 2, ...), from the master at every launch, on every backend:
# every call to the master and every push carries it, so that a launch the master gave up is told from its
# successor and refused (fenced).
LAUNCH_ENV = "ELASTIC_STEP_LAUNCH"
# Exit code of a worker that was refused as fenced: the master had given it up (declared it lost) and requeued its
# lease; it applied nothing since, and exits at once. The master counts its end as the loss it declared.
EXIT_FENCED = 4
FENCED = "fenced: "  # how every refusal of a fenced launch begins (the master's, a PS shard's)


def fenced(error: BaseException | None) -> str | None:
    """The refusal, when `error` (or an error it was raised from) is one of a fenced launch; else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        details = getattr(error, "details", None)
        text = details() if callable(details) else str(error)
        if text and FENCED in text:
            return text[text.index(FENCED) :].splitlines()[0]
        error = error.__cause__ or error.__context__
    return None


def instance_argv(
    role: str,
    master: str,
    index: int,
    model_def: str,
    num_ps: int,
    seed: int,
    minibatch_size: int,
    host: str = "",
    strategy: str = "ps",
    global_batch: str = "scaled",
    weight_column: str | None = None,
    skip_non_finite: bool = False,
    train_data: str = "",
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        f"elastic_step.{role}",
        "--master",
        master,
        "--index",
        str(index),
        "--model-def",
        model_def,
        "--num-ps",
        str(num_ps),
        "--seed",
        str(seed),
        "--minibatch-size",
        str(minibatch_size),
    ]
    if strategy != "ps":
        argv += ["--strategy", strategy, "--global-batch", global_batch]
    if weight_column:  # the training data's sample weights (its manifest names the column)
        argv += ["--weight-column", weight_column]
    if skip_non_finite:
        argv.append("--skip-non-finite")
    if train_data:  # the manifest whose column statistics model(statistics) receives
        argv += ["--train-data", train_data]
    return argv + (["--host", host] if host else [])


def parse_args(role: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m elastic_step.{role}")
    p.add_argument("--master", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--model-def", required=True)
    p.add_argument("--num-ps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minibatch-size", type=int, default=64)
    p.add_argument("--strategy", default="ps", choices=["ps", "allreduce"])
    p.add_argument("--global-batch", default="scaled", choices=["scaled", "fixed"])
    p.add_argument("--weight-column", default=None)
    p.add_argument("--train-data", default="", help="the training data's manifest, for model(statistics)")
    p.add_argument(
        "--skip-non-finite", action="store_true", help="skip a minibatch whose loss or gradient is not finite"
    )
    p.add_argument(
        "--host",
        default=os.environ.get("ELASTIC_STEP_POD_IP", "127.0.0.1"),
        help="address this instance serves on and advertises (PS)",
    )
    args = p.parse_args(argv)
    args.launch = int(os.environ.get(LAUNCH_ENV) or 0)
    args.token = os.environ.get(TOKEN_ENV, "")
    if not args.token:
        p.error(f"{TOKEN_ENV} is not set: the master passes the job token in the environment")
    return args
