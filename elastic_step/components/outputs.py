"""What the component bodies in ops.py share: running the training step from a component's arguments, and
filling its KFP output artifacts from a step's result (elastic_step.steps).

The artifact-taking and the URI-taking variant of a step call the same code here, so they run the same job
and record exactly the same metadata and metrics. (Imported in the step's container, where only KFP's runtime
is loaded: nothing here imports kfp.)
"""

from __future__ import annotations

import math

MANIFEST_FORMAT = "elastic-step/manifest/v1"


def record_prep(info: dict, train_data, eval_data) -> None:
    """Row counts (and the column count) in each Dataset's metadata."""
    train_data.metadata.update(rows=info["train_rows"], columns=info["columns"], format=MANIFEST_FORMAT)
    eval_data.metadata.update(rows=info["eval_rows"], columns=info["columns"], format=MANIFEST_FORMAT)
    if info.get("skipped_rows"):
        train_data.metadata["skipped_rows"] = info["skipped_rows"]
    if info.get("non_finite_rows"):
        train_data.metadata["non_finite_rows"] = info["non_finite_rows"]


def training_metrics(summary: dict) -> dict[str, float]:
    """The scalars a KFP Metrics artifact shows for a training job: the final evaluation, throughput,
    workers lost and relaunched, and what the ledger committed."""
    m = {
        f"eval_{k}": float(v)
        for k, v in summary.get("eval", {}).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # KFP writes JSON
    }
    w = summary.get("workers", {})
    ledger = summary.get("ledger", {})
    m.update(
        throughput_records_per_s=float(summary.get("throughput_records_per_s") or 0.0),
        training_seconds=float(summary.get("training_seconds") or 0.0),
        workers_started=float(w.get("started", 0)),
        workers_lost=float(w.get("lost", 0)),
        workers_relaunched=float(w.get("relaunched", 0)),
        records_committed=float(ledger.get("records_committed", 0)),
        epochs_exact=float(
            sum(1 for e in ledger.get("epochs", []) if e.get("lost") == 0 and e.get("double_applied") == 0)
        ),
    )
    return m


def run_training(train_data: str, eval_data: str, arguments: dict) -> None:
    """A training component's body: `arguments` are the component's own, by name (its artifacts, its
    parameters, the job id's sources, the task's TaskConfig); `train_data` and `eval_data` the manifests, as
    paths or URIs."""
    from elastic_step import spec
    from elastic_step.backends.kubernetes.settings import from_task_config
    from elastic_step.steps import step_job_id, train_step

    a = arguments
    settings = {k: v for k, v in spec.step_values(a, spec.ELASTIC_TRAIN).items() if k not in ("model_def", "job_id")}
    # What the pipeline author set on the training task, which KFP hands over rather than applying it to this
    # step's own pod: the workers' resources and placement, every pod's env and volumes.
    settings = from_task_config(a.get("task_config"), settings)
    job_id = step_job_id(a["job_id"], a["pipeline_run_id"], a["pipeline_task_name"], anchor=a["model"].uri)
    s = train_step(
        train_data,
        eval_data,
        a["model_def"],
        a["model"].path,
        a["report"].path,
        a["summary"].path,
        job_id=job_id,
        **settings,
    )
    record_training(s, a["model"], a["metrics"], a["summary"])


def record_training(summary: dict, model, metrics, summary_artifact) -> None:
    from elastic_step.util.json_text import dumps

    for name, value in training_metrics(summary).items():
        metrics.log_metric(name, value)
    model.metadata.update(
        framework="keras",
        files=["model.keras", "saved_model/"],
        job_id=summary["job_id"],
        eval=dumps(summary.get("eval", {})),
    )
    summary_artifact.metadata.update(status=summary["status"], job_id=summary["job_id"])


def record_evaluation(result: dict, threshold: float, metrics, classification_metrics) -> tuple[float, bool]:
    """Metrics (each eval metric, the threshold, passed as 0/1), the confusion matrix when the model is
    a classifier, and the (score, passed) pair the component returns."""
    for name, value in result["metrics"].items():
        if math.isfinite(float(value)):  # KFP writes its metrics as JSON: a NaN would be a bare NaN there
            metrics.log_metric(name, float(value))
    metrics.log_metric("threshold", float(threshold))
    metrics.log_metric("passed", 1.0 if result["passed"] else 0.0)
    if result.get("confusion"):
        classification_metrics.log_confusion_matrix(result["confusion"]["categories"], result["confusion"]["matrix"])
    return float(result["score"]), bool(result["passed"])
