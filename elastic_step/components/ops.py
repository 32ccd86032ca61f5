"""The KFP v2 components: lightweight Python components on the runtime image whose bodies call
into `elastic_step` (components/steps.py), so kfp.local's SubprocessRunner runs them here and a
cluster runs them in the image. (No `from __future__ import annotations`: KFP reads the real types.)

Set ELASTIC_STEP_IMAGE before importing to build them on another image.
"""

import os
from typing import NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Artifact, ClassificationMetrics, Dataset, Input, Metrics, Model, Output

from elastic_step import __version__

BASE_IMAGE = os.environ.get("ELASTIC_STEP_IMAGE", f"ghcr.io/elastic-step/elastic-step:{__version__}")


@dsl.component(base_image=BASE_IMAGE)
def data_prep_op(source_uri: str, train_data: Output[Dataset], eval_data: Output[Dataset], label: str = "",
                 eval_fraction: float = 0.2, seed: int = 0, shard_rows: int = 50000):
    """CSV / Parquet / JSON lines at any fsspec URI -> validated Parquet shards + a manifest per split."""
    from elastic_step.steps import prep_step

    info = prep_step(source_uri, train_data.path, eval_data.path, label=label, eval_fraction=eval_fraction,
                     seed=seed, shard_rows=shard_rows)
    train_data.metadata.update(rows=info["train_rows"], columns=info["columns"], format="elastic-step/manifest/v1")
    eval_data.metadata.update(rows=info["eval_rows"], columns=info["columns"], format="elastic-step/manifest/v1")


@dsl.component(base_image=BASE_IMAGE)
def elastic_train_op(train_data: Input[Dataset], eval_data: Input[Dataset], model_def: str,
                     model: Output[Model], metrics: Output[Metrics], report: Output[HTML], summary: Output[Artifact],
                     epochs: int = 5, minibatch_size: int = 64, records_per_task: int = 512,
                     min_workers: int = 1, max_workers: int = 2, num_ps: int = 1, strategy: str = "ps",
                     backend: str = "local", worker_image: str = "", worker_cpu: str = "", worker_memory: str = "",
                     worker_priority_class: str = "", ps_priority_class: str = "", seed: int = 0):
    """Elastic training: a master for the length of this step, workers and PS as processes or pods."""
    import json

    from elastic_step.steps import train_metrics, train_step

    s = train_step(train_data.path, eval_data.path, model_def, model.path, report.path, summary.path,
                   epochs=epochs, minibatch_size=minibatch_size, records_per_task=records_per_task,
                   min_workers=min_workers, max_workers=max_workers, num_ps=num_ps, strategy=strategy,
                   backend=backend, image=worker_image, worker_cpu=worker_cpu, worker_memory=worker_memory,
                   worker_priority_class=worker_priority_class, ps_priority_class=ps_priority_class, seed=seed)
    for name, value in train_metrics(s).items():
        metrics.log_metric(name, value)
    model.metadata.update(framework="keras", job_id=s["job_id"], eval=json.dumps(s["eval"]))
    summary.metadata.update(status=s["status"], job_id=s["job_id"])


@dsl.component(base_image=BASE_IMAGE)
def elastic_train_uri_op(train_uri: str, eval_uri: str, model_def: str, model: Output[Model],
                         metrics: Output[Metrics], report: Output[HTML], summary: Output[Artifact], epochs: int = 5,
                         minibatch_size: int = 64, min_workers: int = 1, max_workers: int = 2, num_ps: int = 1,
                         backend: str = "local"):
    """elastic_train_op for the KFP UI, which cannot pass input artifacts: the data are manifest URIs
    (the manifest.json, or its folder, written by `elastic-step data prep`), any fsspec URI."""
    from elastic_step.steps import train_metrics, train_step

    s = train_step(train_uri, eval_uri, model_def, model.path, report.path, summary.path, epochs=epochs,
                   minibatch_size=minibatch_size, min_workers=min_workers, max_workers=max_workers,
                   num_ps=num_ps, backend=backend)
    for name, value in train_metrics(s).items():
        metrics.log_metric(name, value)


@dsl.component(base_image=BASE_IMAGE)
def evaluate_uri_op(model_uri: str, eval_uri: str, model_def: str, metrics: Output[Metrics],
                    threshold: float = 0.9, metric: str = "accuracy"
                    ) -> NamedTuple("EvaluateOutputs", [("score", float), ("passed", bool)]):
    """evaluate_op for the KFP UI: the model folder and the eval manifest as URIs."""
    from collections import namedtuple

    from elastic_step.steps import evaluate_step

    r = evaluate_step(model_uri, eval_uri, model_def, metric=metric, threshold=threshold)
    for name, value in r["metrics"].items():
        metrics.log_metric(name, float(value))
    return namedtuple("EvaluateOutputs", ["score", "passed"])(r["score"], r["passed"])


@dsl.component(base_image=BASE_IMAGE)
def evaluate_op(model: Input[Model], eval_data: Input[Dataset], model_def: str, metrics: Output[Metrics],
                classification_metrics: Output[ClassificationMetrics], threshold: float = 0.9,
                metric: str = "accuracy") -> NamedTuple("EvaluateOutputs", [("score", float), ("passed", bool)]):
    """Evaluate the model on the eval data; `passed` gates publishing (score >= threshold)."""
    from collections import namedtuple

    from elastic_step.steps import evaluate_step

    r = evaluate_step(model.path, eval_data.path, model_def, metric=metric, threshold=threshold)
    for name, value in r["metrics"].items():
        metrics.log_metric(name, float(value))
    metrics.log_metric("threshold", threshold)
    if r["confusion"]:
        classification_metrics.log_confusion_matrix(r["confusion"]["categories"], r["confusion"]["matrix"])
    return namedtuple("EvaluateOutputs", ["score", "passed"])(r["score"], r["passed"])


@dsl.component(base_image=BASE_IMAGE)
def publish_model_op(model: Input[Model], publish_uri: str, passed: bool = True) -> str:
    """Copy the model (model.keras + saved_model/) to publish_uri when `passed`; returns where it went."""
    from elastic_step.steps import publish_step

    return publish_step(model.path, publish_uri, passed)
