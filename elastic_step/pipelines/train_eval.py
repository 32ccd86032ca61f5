"""The train→evaluate pipeline: prep → elastic train → evaluate → `dsl.If(passed)` → publish.

Parameters are strings and numbers only, so the KFP UI can start it. They are the job spec's pipeline
parameters (elastic_step/spec.py; tests/unit/test_spec.py keeps the signature the same). The same pipeline runs on a
cluster and on this machine (`elastic-step pipeline run`, through kfp.local).

Caching: the prep step never caches (its input is a URI whose content changes: a cached prep would
train tomorrow on today's data), so every later step sees new artifacts and runs again too. The
schedule helper builds it with caching off on every task (`build(caching=False)`).

Retries: the training step is retried (TRAIN_RETRY) and resumes its job from the last checkpoint,
as its job id stays the same across retries: the component derives it from KFP's run id and task
name placeholders, each passed as a whole argument (KFP substitutes a placeholder only there).

Scraping: the training step's pod carries the master's scrape labels and annotations (master/health.py), as the
Argo template's does, in the Kubernetes platform config kfp-kubernetes writes (its `podMetadata`; written here
as that library writes it, which this release's kfp pin cannot install beside). KFP has no field for a
container's ports, so the pod has no named port: docs/observability.md's PodMonitor takes it from the annotation.
"""

from kfp import dsl

from elastic_step import spec
from elastic_step.components import data_prep_op, elastic_train_op, evaluate_op, publish_model_op
from elastic_step.master import health

PIPELINE_NAME = "elastic-step-train-eval"
GATE_NAME = "gate-passed"
# KFP's set_retry has no condition: every failure is retried, so a model error costs two more quick
# failures, and few retries are worth it. The back-off is short: a retried step's pod waits, Pending,
# until the scheduler finds room anyway, and a model error is reported sooner. KFP (as Argo's maxDuration)
# retries only within backoff_max_duration of the first attempt's start, 1 h by default: it must outlast the
# longest training, or a step preempted after an hour would not be retried.
TRAIN_RETRY = {"num_retries": 2, "backoff_duration": "15s", "backoff_factor": 2.0, "backoff_max_duration": "168h"}


def scraped(task):
    """`task` (the training step) with the master's scrape labels and annotations on its pod, added to whatever
    Kubernetes platform config it has (kfp-kubernetes' add_pod_label and add_pod_annotation read and add the same)."""
    config = task.platform_config.setdefault("kubernetes", {})
    metadata = config.setdefault("podMetadata", {})
    metadata["labels"] = {**metadata.get("labels", {}), **health.SCRAPE_LABELS}
    metadata["annotations"] = {**metadata.get("annotations", {}), **health.SCRAPE_ANNOTATIONS}
    return task


def build(caching: bool = True):
    """The pipeline function; `caching=False` disables execution caching on every task (for
    recurring runs: kfp.Client's enable_caching=False only reaches the top-level tasks)."""

    def no_cache_unless(task, allowed: bool):
        return task if allowed else task.set_caching_options(False)

    @dsl.pipeline(name=PIPELINE_NAME, description="Elastic TensorFlow training, evaluation and a gated publish.")
    def train_eval(
        source_uri: str,
        model_def: str,
        label: str = "label",
        weight_column: str = "",
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
        threshold: float = 0.9,
        metric: str = "accuracy",
        publish_uri: str = "",
        eval_fraction: float = 0.2,
        non_finite: str = "fail",
        seed: int = 0,
        checkpoint_uri: str = "",
        checkpoint_every: str = "60s",
    ):
        given = dict(locals())  # first: its parameters (and build's names it uses), handed to the steps the spec names
        prep = data_prep_op(**spec.step_values(given, spec.DATA_PREP))
        prep.set_caching_options(False)
        train = no_cache_unless(
            elastic_train_op(
                train_data=prep.outputs["train_data"],
                eval_data=prep.outputs["eval_data"],
                **spec.step_values(given, spec.ELASTIC_TRAIN),
                pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                pipeline_task_name=dsl.PIPELINE_TASK_NAME_PLACEHOLDER,
            ),
            caching,
        )
        train.set_retry(**TRAIN_RETRY)
        scraped(train)
        evaluation = no_cache_unless(
            evaluate_op(
                model=train.outputs["model"],
                eval_data=prep.outputs["eval_data"],
                **spec.step_values(given, spec.EVALUATE),
            ),
            caching,
        )
        with dsl.If(evaluation.outputs["passed"] == True, name=GATE_NAME):  # noqa: E712 - a KFP condition
            no_cache_unless(publish_model_op(model=train.outputs["model"], publish_uri=publish_uri), caching)

    return train_eval


train_eval = build()
