"""The KFP v2 components: lightweight Python components on the runtime image whose bodies call
into `elastic_step` (elastic_step.steps does the work, elastic_step.components.outputs fills the
KFP artifacts), so kfp.local's SubprocessRunner runs them here and a cluster runs them in the image.
(No `from __future__ import annotations`: KFP reads the real types; and the return annotations
are spelled inline, since a component's source runs in the step on its own, with only `typing`.)
The parameters' names, types and defaults are the job spec's (elastic_step/spec.py, where each one's
meaning is); tests/unit/test_spec.py keeps these signatures the same as the spec.

Two shapes of the train and evaluate steps:
- `elastic_train_op`, `evaluate_op` take `Dataset`/`Model` input artifacts: for pipelines (DSL).
- `elastic_train_uri_op`, `evaluate_uri_op` take the same data as URIs (strings), with the same
  parameters and outputs: for the KFP UI, which starts an uploaded component as a one-step
  pipeline and cannot pass input artifacts. `data_prep_op` already takes only strings.

The image: `ghcr.io/elastic-step/elastic-step:<version>`; set ELASTIC_STEP_IMAGE before importing
(or before `elastic-step compile`) to build the components on another image. The image ships kfp,
so the components do not pip-install it at run time (`install_kfp_package=False`).
"""

import functools
import os
from typing import NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Artifact, ClassificationMetrics, Dataset, Input, Metrics, Model, Output

from elastic_step import __version__

DEFAULT_IMAGE = f"ghcr.io/elastic-step/elastic-step:{__version__}"
BASE_IMAGE = os.environ.get("ELASTIC_STEP_IMAGE") or DEFAULT_IMAGE

component = functools.partial(dsl.component, base_image=BASE_IMAGE, install_kfp_package=False)

# The training task's settings (dsl.TaskConfig) that KFP passes to the training components instead of applying them
# to the step's own pod (docs/kfp.md): resources and placement are the workers' (the master needs no GPU and stays
# on on-demand nodes); env and volumes go on the step's pod too, since the master reads the same data and
# credentials. TaskConfigField exists only where pipelines are compiled, not in the step at run time.
TRAIN_TASK_CONFIG = (
    [
        dsl.TaskConfigField.RESOURCES,
        dsl.TaskConfigField.KUBERNETES_TOLERATIONS,
        dsl.TaskConfigField.KUBERNETES_NODE_SELECTOR,
        dsl.TaskConfigField.KUBERNETES_AFFINITY,
        dsl.TaskConfigPassthrough(field=dsl.TaskConfigField.ENV, apply_to_task=True),
        dsl.TaskConfigPassthrough(field=dsl.TaskConfigField.KUBERNETES_VOLUMES, apply_to_task=True),
    ]
    if hasattr(dsl, "TaskConfigField")
    else None
)


@component
def data_prep_op(
    source_uri: str,
    train_data: Output[Dataset],
    eval_data: Output[Dataset],
    label: str = "label",
    weight_column: str = "",
    eval_fraction: float = 0.2,
    seed: int = 0,
    shard_rows: int = 50000,
    non_finite: str = "fail",
):
    """CSV / Parquet / JSON lines at any fsspec URI -> validated Parquet shards + a manifest per split
    (`label`: the label column; empty: none; `weight_column`: a column of sample weights; `non_finite`: fail,
    drop or zero, for NaN, infinite and empty numeric cells)."""
    from elastic_step.components.outputs import record_prep
    from elastic_step.steps import prep_step

    info = prep_step(
        source_uri,
        train_data.path,
        eval_data.path,
        label=label,
        weight_column=weight_column,
        eval_fraction=eval_fraction,
        seed=seed,
        shard_rows=shard_rows,
        non_finite=non_finite,
    )
    record_prep(info, train_data, eval_data)


@component(task_config_passthroughs=TRAIN_TASK_CONFIG)
def elastic_train_op(
    train_data: Input[Dataset],
    eval_data: Input[Dataset],
    model_def: str,
    model: Output[Model],
    metrics: Output[Metrics],
    report: Output[HTML],
    summary: Output[Artifact],
    epochs: int = 1,
    minibatch_size: int = 64,
    records_per_task: int = 0,
    min_workers: int = 1,
    max_workers: int = 2,
    num_ps: int = 1,
    strategy: str = "ps",
    global_batch: str = "scaled",
    skip_non_finite: bool = False,
    early_stop_metric: str = "",
    early_stop_patience: int = 0,
    early_stop_min_delta: float = 0.0,
    hang_timeout: float = 0.0,
    worker_threads: int = 0,
    backend: str = "auto",
    worker_image: str = "",
    worker_cpu: str = "1",
    worker_memory: str = "2Gi",
    worker_priority_class: str = "",
    ps_priority_class: str = "",
    queue: str = "",
    pending_report: float = 300.0,
    ps_cpu: str = "",
    ps_memory: str = "",
    worker_accelerators: str = "",
    ps_accelerators: str = "",
    worker_tolerations: str = "",
    ps_tolerations: str = "",
    worker_node_selector: str = "",
    ps_node_selector: str = "",
    worker_affinity: str = "",
    ps_affinity: str = "",
    job_service_account: str = "",
    env: str = "",
    env_from_secrets: str = "",
    volumes: str = "",
    spot_nodes: str = "auto",
    seed: int = 0,
    job_id: str = "",
    pipeline_run_id: str = "",
    pipeline_task_name: str = "",
    checkpoint_uri: str = "",
    checkpoint_every: str = "60s",
    task_config: dsl.TaskConfig = None,
):
    """Elastic training: a master for the length of this step, workers and PS as processes or pods.

    The job's id is `job_id` when given; else derived from `pipeline_run_id` and `pipeline_task_name`
    (pass dsl.PIPELINE_JOB_ID_PLACEHOLDER and dsl.PIPELINE_TASK_NAME_PLACEHOLDER), else from the model
    artifact's URI: the same in every retry of this step, so a retried step resumes its own job from
    its checkpoints under `checkpoint_uri` (a bucket URI: the step's own folders go with its pod), cut
    every `checkpoint_every` (a time such as 60s or 5m, or a number of records; 0: none). KFP fills `task_config`
    from what the pipeline sets on this task: resources, tolerations, node selector and affinity dress the workers,
    env and volumes every pod."""
    arguments = dict(locals())  # first: the component's own arguments, and nothing else
    from elastic_step.components.outputs import run_training

    run_training(train_data.path, eval_data.path, arguments)


@component
def elastic_train_uri_op(
    train_uri: str,
    eval_uri: str,
    model_def: str,
    model: Output[Model],
    metrics: Output[Metrics],
    report: Output[HTML],
    summary: Output[Artifact],
    epochs: int = 1,
    minibatch_size: int = 64,
    records_per_task: int = 0,
    min_workers: int = 1,
    max_workers: int = 2,
    num_ps: int = 1,
    strategy: str = "ps",
    global_batch: str = "scaled",
    skip_non_finite: bool = False,
    early_stop_metric: str = "",
    early_stop_patience: int = 0,
    early_stop_min_delta: float = 0.0,
    hang_timeout: float = 0.0,
    worker_threads: int = 0,
    backend: str = "auto",
    worker_image: str = "",
    worker_cpu: str = "1",
    worker_memory: str = "2Gi",
    worker_priority_class: str = "",
    ps_priority_class: str = "",
    queue: str = "",
    pending_report: float = 300.0,
    ps_cpu: str = "",
    ps_memory: str = "",
    worker_accelerators: str = "",
    ps_accelerators: str = "",
    worker_tolerations: str = "",
    ps_tolerations: str = "",
    worker_node_selector: str = "",
    ps_node_selector: str = "",
    worker_affinity: str = "",
    ps_affinity: str = "",
    job_service_account: str = "",
    env: str = "",
    env_from_secrets: str = "",
    volumes: str = "",
    spot_nodes: str = "auto",
    seed: int = 0,
    job_id: str = "",
    pipeline_run_id: str = "",
    pipeline_task_name: str = "",
    checkpoint_uri: str = "",
    checkpoint_every: str = "60s",
):
    """elastic_train_op for the KFP UI, which cannot pass input artifacts: the train and eval data are
    manifest URIs (a manifest.json or its folder, as `elastic-step data prep` writes them; any fsspec URI).
    The job's id: as in elastic_train_op. It takes no TaskConfig: the UI cannot set one, and its run form has no
    field for one."""
    arguments = dict(locals())  # first: the component's own arguments, and nothing else
    from elastic_step.components.outputs import run_training

    run_training(train_uri, eval_uri, arguments)


@component
def evaluate_op(
    model: Input[Model],
    eval_data: Input[Dataset],
    model_def: str,
    metrics: Output[Metrics],
    classification_metrics: Output[ClassificationMetrics],
    threshold: float = 0.9,
    metric: str = "accuracy",
) -> NamedTuple("EvaluateOutputs", [("score", float), ("passed", bool)]):
    """Evaluate the model on the eval data; `passed` (score >= threshold) gates publishing."""
    from elastic_step.components.outputs import record_evaluation
    from elastic_step.steps import evaluate_step

    r = evaluate_step(model.path, eval_data.path, model_def, metric=metric, threshold=threshold)
    return record_evaluation(r, threshold, metrics, classification_metrics)


@component
def evaluate_uri_op(
    model_uri: str,
    eval_uri: str,
    model_def: str,
    metrics: Output[Metrics],
    classification_metrics: Output[ClassificationMetrics],
    threshold: float = 0.9,
    metric: str = "accuracy",
) -> NamedTuple("EvaluateOutputs", [("score", float), ("passed", bool)]):
    """evaluate_op for the KFP UI: the model folder (model.keras + saved_model/) and the eval
    manifest as URIs."""
    from elastic_step.components.outputs import record_evaluation
    from elastic_step.steps import evaluate_step

    r = evaluate_step(model_uri, eval_uri, model_def, metric=metric, threshold=threshold)
    return record_evaluation(r, threshold, metrics, classification_metrics)


@component
def publish_model_op(model: Input[Model], publish_uri: str) -> str:
    """Copy the model folder (model.keras + saved_model/) to publish_uri (any fsspec URI); returns
    where it went ("" when publish_uri is empty). Gate it with dsl.If on evaluate_op's `passed`."""
    from elastic_step.steps import publish_step

    return publish_step(model.path, publish_uri, passed=True)
