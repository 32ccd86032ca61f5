"""What each pipeline step does, as plain functions of paths and values.

The KFP components (components/ops.py), the Elyra/v1 components and the Argo templates (through the CLI)
all call these, so a step behaves the same whichever orchestrator runs it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile

import numpy as np

from elastic_step.errors import ConfigError
from elastic_step.util import json_text


def prep_step(source_uri: str, train_dir: str, eval_dir: str, *, label: str, **settings) -> dict:
    """Prepare the source into two folders, each a manifest + its Parquet shards. `label`: the label column
    (empty: none); `settings`: the spec's other data prep parameters (eval_fraction, seed, shard_rows)."""
    from elastic_step.data.prep import prepare

    with tempfile.TemporaryDirectory(prefix="elastic-step-prep-") as tmp:
        settings["weight_column"] = settings.get("weight_column") or None  # empty: none
        r = prepare(source_uri, os.path.join(tmp, "out"), label=label or None, **settings)
        for split, dest in (("train", train_dir), ("eval", eval_dir)):
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(os.path.join(tmp, "out", split), dest)
    return {
        "train_rows": r.train.total_rows,
        "eval_rows": r.eval.total_rows,
        "skipped_rows": r.train.skipped_rows + r.eval.skipped_rows,
        "columns": len(r.train.schema),
        "non_finite_rows": r.train.non_finite.get("rows", 0),
    }


def train_step(
    train_data: str, eval_data: str, model_def: str, model_dir: str, report_path: str, summary_path: str, **settings
) -> dict:
    """Run the elastic training job; the model folder gets model.keras + saved_model/."""
    from elastic_step.master.api import TrainConfig
    from elastic_step.master.job import REPORT_FILE, SUMMARY_FILE, train
    from elastic_step.model_io import KERAS_FILE, SAVED_MODEL_DIR
    from elastic_step.spec import is_unset

    # Empty strings are how pipeline UIs say "not set" (but an empty worker_cpu asks for no request).
    settings = {k: v for k, v in settings.items() if not is_unset(k, v)}
    with tempfile.TemporaryDirectory(prefix="elastic-step-train-") as out:
        summary = train(
            TrainConfig(model_def=model_def, train_data=train_data, eval_data=eval_data, output=out, **settings)
        )
        os.makedirs(model_dir, exist_ok=True)
        shutil.copy(os.path.join(out, KERAS_FILE), os.path.join(model_dir, KERAS_FILE))
        shutil.copytree(
            os.path.join(out, SAVED_MODEL_DIR), os.path.join(model_dir, SAVED_MODEL_DIR), dirs_exist_ok=True
        )
        shutil.copy(os.path.join(out, REPORT_FILE), report_path)
        shutil.copy(os.path.join(out, SUMMARY_FILE), summary_path)
    return summary


def step_job_id(job_id: str = "", run_id: str = "", task_name: str = "", anchor: str = "") -> str | None:
    """The training job's id in a pipeline step: the same in every retry of the step, and another in
    every other run or task, so a retried step resumes its own job's checkpoint and takes over its pods.

    - `job_id`, when given, wins as it is (the Kubernetes backend checks it can name pods).
    - Else from `run_id` and `task_name`: the values of KFP's PIPELINE_JOB_ID_PLACEHOLDER and
      PIPELINE_TASK_NAME_PLACEHOLDER. KFP resolves them once per task, before the executor pod that a
      retry replaces, so every attempt sees the same ones; kfp.local resolves them to a random run id
      and the task's name.
    - Else, when those did not resolve (a component uploaded on its own, or used without passing
      them: KFP substitutes a placeholder only where it is a task's whole argument), from `anchor`,
      the URI of the step's output artifact, which KFP also fixes once per task.
    - Else None: the job gets a random id, and a retry starts over.

    A derived id is `<task name>-<16 hex of a digest>`: at most 41 characters of [a-z0-9-], so
    `<job>-<role>-<index>-<launch>` pod names and the `elastic-step/job` label stay valid."""
    if job_id:
        return job_id

    def resolved(value: str) -> bool:
        return bool(value) and "{{" not in value

    if resolved(run_id):
        key = f"{run_id}/{task_name if resolved(task_name) else ''}"
    elif resolved(anchor):
        key = anchor
    else:
        return None
    readable = re.sub(r"[^a-z0-9]+", "-", task_name.lower()).strip("-")[:24].strip("-") if resolved(task_name) else ""
    return f"{readable or 'es'}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def evaluate_step(model_uri: str, eval_data: str, model_def: str, *, metric: str, threshold: float) -> dict:
    """Evaluate a trained model and decide the gate: {"score", "passed", "metrics", "confusion"}."""
    from elastic_step.data.manifest import load_manifest
    from elastic_step.evaluation import evaluate
    from elastic_step.model_def import load_model_def
    from elastic_step.model_io import load_model

    md = load_model_def(model_def)
    r = evaluate(load_model(model_uri), md, load_manifest(eval_data), keep_predictions=True)
    if metric not in r:
        raise ConfigError(
            f"The gate metric {metric!r} is not computed: eval_metrics() of {model_def!r} gives "
            f"{sorted(k for k in r if k not in ('labels', 'predictions', 'records'))}."
        )
    labels, preds = r.pop("labels"), r.pop("predictions")
    score = float(r[metric])
    return {
        "score": score,
        "passed": bool(score >= threshold),
        "metrics": r,
        "confusion": confusion_matrix(labels, preds),
    }


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray) -> dict | None:
    """Categories and matrix for a classifier's outputs (softmax rows or one sigmoid column)."""
    if predictions.ndim == 2 and predictions.shape[1] > 1:
        predicted = predictions.argmax(axis=1)
        n = predictions.shape[1]
    elif predictions.size and predictions.reshape(len(predictions), -1).shape[1] == 1:
        predicted = (predictions.reshape(-1) >= 0.5).astype(int)
        n = 2
    else:
        return None
    truth = np.asarray(labels).reshape(-1).astype(int)
    matrix = np.zeros((n, n), dtype=int)
    np.add.at(matrix, (truth, predicted), 1)
    return {"categories": [str(i) for i in range(n)], "matrix": matrix.tolist()}


def publish_step(model_dir: str, publish_uri: str, passed: bool) -> str:
    """Copy the model folder (a local path or any fsspec URI) to `publish_uri` (any fsspec URI) when the
    gate passed: model.keras last, so a reader that finds it finds the whole model."""
    import fsspec

    from elastic_step.model_io import KERAS_FILE
    from elastic_step.util.storage import copy_folder, explain

    if not passed:
        return ""
    if not publish_uri:
        return ""
    try:
        fs, root = fsspec.core.url_to_fs(model_dir)
        found = fs.exists(f"{root.rstrip('/')}/{KERAS_FILE}")
    except Exception as e:  # noqa: BLE001 - any storage error: one clear paragraph
        raise ConfigError(explain(model_dir, e, "read the model to publish from")) from None
    if not found:
        raise ConfigError(f"No {KERAS_FILE} in {model_dir}: pass the folder the training step wrote its model to.")
    try:
        copy_folder(model_dir, publish_uri, last=KERAS_FILE)
    except Exception as e:  # noqa: BLE001 - any storage error: one clear paragraph
        raise ConfigError(explain(publish_uri, e, "publish the model to")) from None
    return publish_uri


def write_json(path: str, data) -> None:
    json_text.write_json(path, data)
