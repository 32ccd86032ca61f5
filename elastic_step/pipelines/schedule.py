"""`elastic-step schedule create`: nightly (or any) retraining on a KFP cluster.

Compiles the train→evaluate pipeline with caching off on every task, then calls
`kfp.Client(host).create_recurring_run` with a 6-field cron (seconds first, as KFP's scheduler,
robfig/cron, reads it), `enable_caching=False` (so each run really retrains), `max_concurrency=1`
(one run at a time) and `no_catchup=True` (runs missed while the schedule was paused are not
replayed).
"""

from __future__ import annotations

import os
import re
import tempfile

from elastic_step.errors import ConfigError

_MONTHS = "JAN FEB MAR APR MAY JUN JUL AUG SEP OCT NOV DEC".split()
_DAYS = "SUN MON TUE WED THU FRI SAT".split()
# name, lowest, highest, names (index + lowest = value), whether "?" is allowed
FIELDS = (
    ("second", 0, 59, None, False),
    ("minute", 0, 59, None, False),
    ("hour", 0, 23, None, False),
    ("day of month", 1, 31, None, True),
    ("month", 1, 12, _MONTHS, False),
    ("day of week", 0, 6, _DAYS, True),
)
_TERM = re.compile(r"^(?P<range>\*|[0-9A-Za-z]+(?:-[0-9A-Za-z]+)?)(?:/(?P<step>[0-9]+))?$")
EXAMPLE = '"0 0 2 * * *" (02:00 every day)'


def _value(token: str, lo: int, hi: int, names) -> int | None:
    if token.isdigit():
        v = int(token)
    elif names and token.upper() in names:
        v = names.index(token.upper()) + lo
    else:
        return None
    return v if lo <= v <= hi else None


def _field_ok(text: str, lo: int, hi: int, names, question: bool) -> bool:
    if text == "?":
        return question
    for term in text.split(","):
        m = _TERM.match(term)
        if not m:
            return False
        if m["step"] is not None and int(m["step"]) < 1:
            return False
        if m["range"] == "*":
            continue
        bounds = [_value(t, lo, hi, names) for t in m["range"].split("-")]
        if any(b is None for b in bounds) or (len(bounds) == 2 and bounds[0] > bounds[1]):
            return False
    return True


def validate_cron(cron: str) -> str:
    """The cron expression, whitespace normalised, or a ConfigError saying what is wrong with it."""
    fields = cron.split()
    cron = " ".join(fields)
    if len(fields) != 6:
        hint = (
            f' It has 5 fields, the classic crontab form; KFP wants seconds first: "0 {cron}" runs at '
            f"second 0 of the same times."
            if len(fields) == 5
            else f" It has {len(fields)}."
        )
        raise ConfigError(
            f"--cron {cron!r} is not a 6-field cron expression (second minute hour day-of-month "
            f"month day-of-week), e.g. {EXAMPLE}.{hint}"
        )
    for text, (name, lo, hi, names, question) in zip(fields, FIELDS):
        if not _field_ok(text, lo, hi, names, question):
            allowed = f"{lo}-{hi}" + (f" or {names[0]}-{names[-1]}" if names else "") + (", ?" if question else "")
            raise ConfigError(
                f"--cron {cron!r}: the {name} field {text!r} is not valid (a 6-field cron expression "
                f"takes *, a value {allowed}, a-b ranges, /steps and comma lists there), "
                f"e.g. {EXAMPLE}."
            )
    return cron


def create_schedule(
    host: str,
    cron: str,
    params: dict,
    experiment: str = "elastic-step",
    name: str = "elastic-step-train-eval-nightly",
    namespace: str | None = None,
    description: str = "",
    service_account: str | None = None,
    pipeline_root: str | None = None,
) -> dict:
    import kfp
    from kfp import compiler

    from elastic_step.pipelines.train_eval import PIPELINE_NAME, build

    cron = validate_cron(cron)
    params = {k: v for k, v in params.items() if v is not None}
    client = kfp.Client(host=host, namespace=namespace)
    experiment_id = client.create_experiment(experiment, namespace=namespace).experiment_id
    with tempfile.TemporaryDirectory(prefix="elastic-step-schedule-") as tmp:
        package = os.path.join(tmp, f"{PIPELINE_NAME}.yaml")
        compiler.Compiler().compile(build(caching=False), package)
        run = client.create_recurring_run(
            experiment_id=experiment_id,
            job_name=name,
            description=description or None,
            cron_expression=cron,
            max_concurrency=1,
            no_catchup=True,
            pipeline_package_path=package,
            params=params,
            enable_caching=False,
            service_account=service_account or None,
            pipeline_root=pipeline_root or None,
        )
    return {
        "recurring_run_id": run.recurring_run_id,
        "experiment_id": experiment_id,
        "experiment": experiment,
        "name": name,
        "cron": cron,
        "max_concurrency": 1,
        "no_catchup": True,
        "caching": False,
        "parameters": params,
    }
