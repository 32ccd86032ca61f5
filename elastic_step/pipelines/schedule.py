"""`elastic-step schedule create`: nightly (or any) retraining on a KFP cluster.

Compiles the train→evaluate pipeline, then calls `kfp.Client().create_recurring_run` with a
6-field cron (seconds first, as KFP's scheduler reads it), caching off so each run really
retrains, one run at a time, and no catch-up of runs missed while the schedule was paused.
"""
from __future__ import annotations

import os
import re
import tempfile

from elastic_step.errors import ConfigError

_FIELD = r"(\*|\?|[0-9A-Za-z,\-*/]+)"
CRON = re.compile(rf"^{_FIELD}(\s+{_FIELD}){{5}}$")


def validate_cron(cron: str) -> str:
    cron = " ".join(cron.split())
    if not CRON.match(cron):
        n = len(cron.split())
        hint = (f' It has {n} fields; KFP wants 6, seconds first: "0 {cron}" runs at second 0.'
                if n == 5 else "")
        raise ConfigError(f"--cron {cron!r} is not a 6-field cron expression (second minute hour day month "
                          f"weekday), e.g. \"0 0 2 * * *\" for 02:00 every day.{hint}")
    return cron


def create_schedule(host: str, cron: str, params: dict, experiment: str = "elastic-step",
                    name: str = "elastic-step-train-eval-nightly", namespace: str | None = None) -> dict:
    import kfp
    from kfp import compiler

    from elastic_step.pipelines.train_eval import train_eval

    cron = validate_cron(cron)
    client = kfp.Client(host=host, namespace=namespace)
    experiment_id = client.create_experiment(experiment, namespace=namespace).experiment_id
    with tempfile.TemporaryDirectory(prefix="elastic-step-schedule-") as tmp:
        package = os.path.join(tmp, "train_eval.yaml")
        compiler.Compiler().compile(train_eval, package)
        run = client.create_recurring_run(
            experiment_id=experiment_id, job_name=name, cron_expression=cron, max_concurrency=1,
            no_catchup=True, pipeline_package_path=package, params=params, enable_caching=False)
    return {"recurring_run_id": run.recurring_run_id, "experiment_id": experiment_id, "cron": cron,
            "name": name}
