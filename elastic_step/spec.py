"""The job spec: every parameter of a training job and of the train→evaluate pipeline, declared once.

A parameter has a name, a type, a default, a help text and the surfaces that expose it. From here
come the `elastic-step` command line's parsers (`train`, `pipeline run`, `schedule create`), the
Argo WorkflowTemplate's parameters (elastic_step/pipelines/argo.py), the v1 (Elyra) components'
inputs and the command lines they run (elastic_step/pipelines/compile.py), TrainConfig's defaults
(elastic_step/master/api.py) and docs/parameters.md. The KFP components and pipeline are Python
signatures that KFP reads literally, so they are written out; tests/unit/test_spec.py checks them,
and TrainConfig's fields, against this spec: names, types and defaults.

Adding a parameter: one `Param` below (a training parameter also needs its TrainConfig field and
the code that reads it; a KFP surface, its argument in the signature), then `elastic-step compile`,
which regenerates the YAMLs and docs/parameters.md (a test fails while they are stale).
"""

from __future__ import annotations

import argparse
import dataclasses

# Surfaces: where a parameter is exposed.
CONFIG = "config"  # a field of TrainConfig, the master's validated configuration
TRAIN = "train"  # `elastic-step train`
RUN = "run"  # `elastic-step pipeline run` (the pipeline on this machine, through kfp.local)
PREP = "prep"  # `elastic-step data prep`
EVAL = "evaluate"  # `elastic-step evaluate`
PIPELINE = "pipeline"  # the KFP pipeline train_eval, the Argo WorkflowTemplate and `elastic-step schedule create`
COMPONENT = "component"  # the KFP component(s) of each of its steps (e.g. elastic_train_op, elastic_train_uri_op)
V1 = "v1"  # the v1 (Elyra) component of each of its steps, which runs the CLI
SURFACES = {
    PREP: "prep",
    TRAIN: "train",
    EVAL: "evaluate",
    RUN: "run",
    PIPELINE: "pipeline",
    COMPONENT: "component",
    V1: "v1",
    CONFIG: "config",
}

# The pipeline's steps; each is a component folder (components/<step>/) and a step of the Argo template.
DATA_PREP, ELASTIC_TRAIN, EVALUATE, PUBLISH_MODEL = "data_prep", "elastic_train", "evaluate", "publish_model"


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()  # the default of a parameter that has none: it must be given


@dataclasses.dataclass(frozen=True)
class Param:
    name: str  # Python, KFP and TrainConfig name; Argo's is the same with dashes
    type: type  # int, float, str or bool (a bool's flag alone means true; `--flag false` for a pipeline's value)
    default: object  # REQUIRED, or a value of `type` (None: not given)
    help: str  # one text for every surface: the CLI's help, Argo's and v1's descriptions, the docs
    on: frozenset[str]  # the surfaces (above)
    steps: tuple[str, ...] = ()  # the pipeline steps that take it (their components, Argo step and v1 component)
    flag: str = ""  # the CLI flag; empty: --<name with dashes>
    aliases: tuple[str, ...] = ()  # other flags that still work
    choices: tuple[str, ...] = ()  # the values it takes (checked by argparse, unless checked_by_config)
    checked_by_config: bool = False  # TrainConfig.validate checks the value and words the error itself
    metavar: str | None = None
    empty_is_a_value: bool = False  # an empty string means something (not "unset"): see is_unset
    cli_required: bool | None = None  # None: required on the CLI when it has no default

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def argo_name(self) -> str:
        return self.name.replace("_", "-")

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


def _on(*surfaces: str) -> frozenset[str]:
    return frozenset(surfaces)


# A training parameter everywhere: the master's config, `train`, the pipeline, its training component(s) and its
# v1 component.
_TRAINING = (CONFIG, TRAIN, PIPELINE, COMPONENT, V1)

PARAMS: tuple[Param, ...] = (
    # ---------------------------------------------------------------- data
    Param(
        "source_uri",
        str,
        REQUIRED,
        "training data: CSV, Parquet or JSON lines; a file, folder or glob, any fsspec URI",
        _on(PREP, RUN, PIPELINE, COMPONENT, V1),
        (DATA_PREP,),
        flag="--source",
    ),
    Param(
        "model_def",
        str,
        REQUIRED,
        "the model: an importable module path (pkg.module), or a path/URI of a .py file",
        _on(*_TRAINING, EVAL, RUN),
        (ELASTIC_TRAIN, EVALUATE),
    ),
    Param("train_data", str, REQUIRED, "train manifest.json (or its folder)", _on(CONFIG, TRAIN), cli_required=False),
    Param("eval_data", str, None, "eval manifest.json (or its folder)", _on(CONFIG, TRAIN)),
    Param(
        "output",
        str,
        REQUIRED,
        "`train`: the folder for model.keras, saved_model/, summary.json, report.html "
        "(local, gs://, s3://); `pipeline run`: the folder whose pipeline_root/ gets every artifact",
        _on(CONFIG, TRAIN, RUN),
    ),
    Param(
        "label",
        str,
        "label",
        "the label column: every row must have one (empty: no label column, nothing checked)",
        _on(PREP, RUN, PIPELINE, COMPONENT, V1),
        (DATA_PREP,),
        empty_is_a_value=True,
    ),
    Param(
        "weight_column",
        str,
        "",
        "a numeric column of sample weights: each record's loss weighed by it in training and evaluation, as "
        "fit's sample_weight; recorded in the manifest (empty: none, every record weighs 1)",
        _on(PREP, RUN, PIPELINE, COMPONENT, V1),
        (DATA_PREP,),
    ),
    Param(
        "eval_fraction",
        float,
        0.2,
        "share of the rows held out for evaluation",
        _on(PREP, RUN, PIPELINE, COMPONENT, V1),
        (DATA_PREP,),
    ),
    Param("shard_rows", int, 50000, "rows per Parquet shard", _on(PREP, COMPONENT, V1), (DATA_PREP,)),
    Param(
        "on_bad_rows",
        str,
        "fail",
        "a row that does not parse: fail, or skip it (counted)",
        _on(PREP, V1),
        (DATA_PREP,),
        choices=("fail", "skip"),
    ),
    Param(
        "non_finite",
        str,
        "fail",
        "NaN, infinite or empty cells in numeric and bool columns: fail (naming each column's first rows), "
        "drop their rows, or zero (set them to 0); counted in the manifest",
        _on(PREP, RUN, PIPELINE, COMPONENT, V1),
        (DATA_PREP,),
        choices=("fail", "drop", "zero"),
    ),
    Param(
        "schema",
        str,
        None,
        'a JSON schema file for the source, {"fields": [{"name", "type"}]} (none: the types are inferred)',
        _on(PREP),
    ),
    Param("seed", int, 0, "seed of the split and of training", _on(*_TRAINING, PREP, RUN), (DATA_PREP, ELASTIC_TRAIN)),
    # ---------------------------------------------------------------- training
    Param("epochs", int, 1, "passes over the training data", _on(*_TRAINING, RUN), (ELASTIC_TRAIN,)),
    Param("minibatch_size", int, 64, "records per minibatch", _on(*_TRAINING, RUN), (ELASTIC_TRAIN,)),
    Param(
        "records_per_task",
        int,
        0,
        "records per task leased to a worker; 0: 32 minibatches, fewer when an epoch would hold under 8 tasks",
        _on(*_TRAINING, RUN),
        (ELASTIC_TRAIN,),
    ),
    Param("min_workers", int, 1, "training starts once this many workers run", _on(*_TRAINING, RUN), (ELASTIC_TRAIN,)),
    Param(
        "max_workers",
        int,
        2,
        "workers asked for; pending ones join when the scheduler finds room",
        _on(*_TRAINING, RUN),
        (ELASTIC_TRAIN,),
    ),
    Param("num_ps", int, 1, "parameter server shards (strategy ps)", _on(*_TRAINING, RUN), (ELASTIC_TRAIN,)),
    Param(
        "strategy",
        str,
        "ps",
        "ps: asynchronous SGD with parameter servers; allreduce: synchronous SGD, an elastic "
        "ring AllReduce between the workers, no parameter servers",
        _on(*_TRAINING, RUN),
        (ELASTIC_TRAIN,),
        choices=("ps", "allreduce"),
        checked_by_config=True,
    ),
    Param(
        "global_batch",
        str,
        "scaled",
        "allreduce: scaled (world x minibatch, the learning rate scaled by "
        "world/max-workers) or fixed (max-workers x minibatch, kept by gradient accumulation)",
        _on(*_TRAINING, RUN),
        (ELASTIC_TRAIN,),
        choices=("scaled", "fixed"),
    ),
    Param(
        "pushes_in_flight",
        int,
        1,
        "ps: pushes each worker keeps in flight. 1: a lone worker trains as Keras fit "
        "does. 2: its step overlaps the PS's update, each gradient one update stale; for a model without embedding "
        "tables only while other workers push (a lone worker's call of several minibatches overlaps its push anyway)",
        _on(CONFIG, TRAIN),
    ),
    Param(
        "minibatches_per_push",
        int,
        1,
        "ps: each push carries the mean gradient of K minibatches computed at the "
        "same values, as Keras's gradient_accumulation_steps=K applies them: K times fewer updates of the PS per "
        "epoch, and fewer round trips for a small model. 1: one minibatch per push",
        _on(CONFIG, TRAIN),
        metavar="K",
    ),
    Param(
        "worker_threads",
        int,
        0,
        "TensorFlow intra-op threads of each worker (the threads one op is split over). 0: automatic: on the local "
        "backend, a worker gets the step's cores shared among max_workers, at least 1 (the PS shards 1 "
        "each); on Kubernetes, a worker gets its worker_cpu, rounded up (TensorFlow would size its pool by the "
        "node's cores); else TensorFlow's own default. On the local backend a worker's inter-op threads follow: 2 "
        "for a step of 10 M multiply-adds a minibatch or more on 2 or more of these threads, else 1",
        _on(*_TRAINING, RUN),
        (ELASTIC_TRAIN,),
        metavar="N",
    ),
    Param(
        "skip_non_finite",
        bool,
        False,
        "skip a minibatch whose loss or gradient is NaN or infinite (nothing of it is applied; summary.json counts "
        "the skipped records) instead of failing the job, as Keras's TerminateOnNaN would",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "early_stop_metric",
        str,
        "",
        "stop training when this metric of the per-epoch evaluation (loss, <output>_loss or a name of "
        "eval_metrics()) has not improved for early_stop_patience epochs, and keep the best epoch's weights, as "
        "Keras's EarlyStopping(restore_best_weights=True); a loss improves down, any other metric up (empty: off)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "early_stop_patience",
        int,
        0,
        "early stopping: epochs without improvement before the job stops",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "early_stop_min_delta",
        float,
        0.0,
        "early stopping: the least change of the metric that counts as an improvement",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "backend",
        str,
        "auto",
        "auto: kubernetes when this step runs in a pod whose service account holds the "
        "Role's verbs, else local (the log says which and why); local: workers and parameter servers are "
        "processes of the step; kubernetes: they are pods in the step's namespace",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
        choices=("auto", "local", "kubernetes"),
        checked_by_config=True,
        metavar="{auto,local,kubernetes}",
    ),
    Param(
        "job_id",
        str,
        "",
        "stable id of the job: names its pods and its checkpoints' folder, and a retried step "
        "that reuses it resumes the job and takes over its pods (empty: a new id)",
        _on(CONFIG, TRAIN, COMPONENT),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "worker_image",
        str,
        "",
        "kubernetes: image of the worker and parameter server pods (empty: the step's own image, its -gpu variant "
        "for pods with accelerators)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
        aliases=("--image",),
    ),
    Param(
        "worker_cpu",
        str,
        "1",
        "kubernetes: CPU of each worker pod, requests = limits, e.g. 1 or 500m (empty: none)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
        empty_is_a_value=True,
    ),
    Param(
        "worker_memory",
        str,
        "2Gi",
        "kubernetes: memory of each worker pod, requests = limits, e.g. 2Gi (empty: none)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
        empty_is_a_value=True,
    ),
    Param(
        "worker_priority_class",
        str,
        "",
        "kubernetes: PriorityClass of the worker pods (empty: elastic-low when it exists)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "ps_priority_class",
        str,
        "",
        "kubernetes: PriorityClass of the parameter server pods (empty: elastic-high when it exists)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "queue",
        str,
        "",
        "kubernetes: the Kueue LocalQueue of the job's pods, in the step's namespace: each worker is a workload of "
        "its own, admitted as the quota allows, and the parameter servers one group, admitted whole (empty: none, "
        "the pods are created directly)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
        metavar="LOCALQUEUE",
    ),
    Param(
        "pending_report",
        float,
        300.0,
        "kubernetes: seconds a worker or parameter server pod may stay pending before the master reports what "
        "holds it, in its log and summary.json: Kueue's Workload and its condition while a queue holds the pod, "
        "else the scheduler's reason. The pod keeps waiting, and is reported again after each further such wait. "
        "0: never",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
        metavar="SECONDS",
    ),
    Param(
        "ps_cpu",
        str,
        "",
        "kubernetes: CPU of each parameter server pod, requests = limits, e.g. 1 or 500m (empty: none)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "ps_memory",
        str,
        "",
        "kubernetes: memory of each parameter server pod, requests = limits, e.g. 4Gi (empty: none)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "worker_accelerators",
        str,
        "",
        "kubernetes: extended resources of each worker pod, NAME=COUNT[,...], e.g. nvidia.com/gpu=1 (empty: none)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "ps_accelerators",
        str,
        "",
        "kubernetes: extended resources of each parameter server pod, as worker_accelerators (empty: none)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "worker_tolerations",
        str,
        "",
        "kubernetes: tolerations of the worker pods, KEY[=VALUE]:EFFECT[,...] as kubectl taint writes them "
        "(EFFECT: NoSchedule, PreferNoSchedule or NoExecute; KEY:EFFECT tolerates any value), or a JSON list of "
        "Tolerations (empty: none besides spot_nodes')",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "ps_tolerations",
        str,
        "",
        "kubernetes: tolerations of the parameter server pods, as worker_tolerations (empty: none)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "worker_node_selector",
        str,
        "",
        "kubernetes: node selector of the worker pods, KEY=VALUE[,...] or a JSON object (empty: none)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "ps_node_selector",
        str,
        "",
        "kubernetes: node selector of the parameter server pods, as worker_node_selector (empty: none)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "worker_affinity",
        str,
        "",
        "kubernetes: affinity of the worker pods, a JSON Affinity object, added to spot_nodes' preference "
        "(empty: none besides it)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "ps_affinity",
        str,
        "",
        "kubernetes: affinity of the parameter server pods, as worker_affinity",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "job_service_account",
        str,
        "",
        "kubernetes: service account of the worker and parameter server pods, e.g. for a cloud identity; its API "
        "token is not mounted (empty: the namespace's default)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "env",
        str,
        "",
        "kubernetes: environment variables of the worker and parameter server pods, NAME=VALUE[,...] or a JSON "
        "list of EnvVars (empty: none)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "env_from_secrets",
        str,
        "",
        "kubernetes: Secrets as environment variables of the worker and parameter server pods: SECRET (every key) "
        "or NAME=SECRET/KEY (one), comma-separated (empty: none)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "volumes",
        str,
        "",
        "kubernetes: volumes of the worker and parameter server pods, KIND:NAME:/PATH[:ro][,...] (KIND: pvc, "
        "secret, configmap or emptydir), or a JSON object {volumes, volumeMounts} (empty: none)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "spot_nodes",
        str,
        "auto",
        "kubernetes: the labels of spot (preemptible) nodes, whose NoSchedule taint the workers tolerate and which "
        "they prefer, while the parameter servers prefer other nodes: auto (GKE, Karpenter, AKS and EKS spot "
        "labels), none (no spot handling) or KEY=VALUE[,...]",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
    ),
    Param(
        "max_relaunches",
        int,
        20,
        "relaunches of lost workers and parameter servers per job: a crash loop fails the job instead of spinning",
        _on(CONFIG, TRAIN),
    ),
    Param(
        "health_port",
        int,
        -1,
        "the master's liveness endpoint, HTTP GET /healthz on this port: 200 while its pump turns (or it is busy "
        "cutting a checkpoint, restoring or saving the model), 503 once the pump has stalled; -1: 8080 when this "
        "step runs in a Kubernetes pod, else none; 0: none",
        _on(CONFIG, TRAIN),
        metavar="PORT",
    ),
    Param(
        "hang_timeout",
        float,
        0.0,
        "seconds a worker that holds a lease may go without committing progress before it is declared hung: "
        "stopped, its lease requeued from its watermark, and replaced. 0: measured, max(30 s, 10 times its own "
        "recent time between reports). Its clock starts at its first commit (a long first step is not a hang) and "
        "stops while a checkpoint is cut, a state restored or an epoch evaluated; before it, the start-up bound, "
        "max(180 s, 3 times the job's slowest first commit), which this only lengthens. The same bound holds for a "
        "parameter server that does not answer the master's probe (then restored from the last checkpoint)",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
        metavar="SECONDS",
    ),
    Param(
        "progress",
        str,
        "auto",
        "how training shows its progress on stderr",
        _on(CONFIG, TRAIN),
        choices=("auto", "bar", "lines", "off"),
    ),
    # ---------------------------------------------------------------- checkpoints
    Param(
        "checkpoint_uri",
        str,
        "",
        "where the job's checkpoints go, as CHECKPOINT_URI/<job id>/ (any fsspec URI: "
        "a bucket, so that a step retried in a new pod resumes); empty: OUTPUT/checkpoints/<job id>/, which lasts "
        "as long as the output does",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
        metavar="URI",
    ),
    Param(
        "checkpoint_every",
        str,
        "60s",
        "cut a checkpoint of the parameter servers (or the allreduce members) and "
        "the ledger every INTERVAL: a time (60s, 5m) or a number of committed records (50000); 0: never",
        _on(*_TRAINING),
        (ELASTIC_TRAIN,),
        metavar="INTERVAL",
    ),
    Param(
        "resume",
        str,
        "auto",
        "auto: resume from this job's last checkpoint when there is one (a retried step); never: start over",
        _on(CONFIG, TRAIN),
        choices=("auto", "never"),
    ),
    # ---------------------------------------------------------------- evaluation and publishing
    Param(
        "threshold",
        float,
        0.9,
        "the gate: the model is published only when its metric is at least this",
        _on(EVAL, RUN, PIPELINE, COMPONENT, V1),
        (EVALUATE,),
    ),
    Param(
        "metric",
        str,
        "accuracy",
        "the eval metric the gate compares",
        _on(EVAL, RUN, PIPELINE, COMPONENT, V1),
        (EVALUATE,),
    ),
    Param(
        "publish_uri",
        str,
        "",
        "where a model that passes the gate is copied (a folder URI; empty: nowhere)",
        _on(RUN, PIPELINE),
    ),
)

BY_NAME: dict[str, Param] = {p.name: p for p in PARAMS}
DEFAULTS: dict[str, object] = {p.name: p.default for p in PARAMS}


def params(surface: str, step: str | None = None) -> list[Param]:
    """The parameters on `surface` (and of `step`), in the spec's order."""
    return [p for p in PARAMS if surface in p.on and (step is None or step in p.steps)]


def is_unset(name: str, value) -> bool:
    """How a pipeline step tells "not given" from a value: None, or an empty string (pipeline UIs have no
    "unset"), unless an empty string means something for this parameter."""
    return value is None or (value == "" and not BY_NAME[name].empty_is_a_value)


# ---------------------------------------------------------------- the command line
def add_arguments(parser: argparse.ArgumentParser, surface: str, only: tuple[str, ...] = ()) -> None:
    """The CLI options of the parameters on `surface` (only those named in `only`, when given)."""
    for p in params(surface):
        if only and p.name not in only:
            continue
        kwargs: dict = {"dest": p.name, "help": p.help.replace("%", "%%")}
        if p.type is bool:  # `--flag` alone, or `--flag true|false` as a pipeline passes its value
            kwargs.update(type=parse_bool, nargs="?", const=True, metavar="{true,false}")
        elif p.type is not str:
            kwargs["type"] = p.type
        required = p.required if p.cli_required is None else p.cli_required
        if required:
            kwargs["required"] = True
        elif p.default is not REQUIRED:
            kwargs["default"] = p.default
        if p.choices and not p.checked_by_config:
            kwargs["choices"] = list(p.choices)
        if p.metavar:
            kwargs["metavar"] = p.metavar
        parser.add_argument(p.cli_flag, *p.aliases, **kwargs)


def parse_bool(text: str) -> bool:
    """A bool parameter's value as a command line or a pipeline gives it (Argo and v1 pass `True`/`False`)."""
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(str(text).lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def values(args: argparse.Namespace, surface: str) -> dict:
    """The parsed values of the parameters on `surface`, by name."""
    return {p.name: getattr(args, p.name) for p in params(surface)}


def step_values(given: dict, step: str, surface: str = COMPONENT) -> dict:
    """The values in `given` (a pipeline's or a component's own arguments, by name) of the parameters that
    `step` takes on `surface`: how the pipeline hands its parameters to its steps, and a component to its job."""
    return {p.name: given[p.name] for p in params(surface, step) if p.name in given}


def cli_args(**given) -> list[str]:
    """The command line that passes these parameter values: `--flag value` each, with the spec's flags
    (`source_uri="s"` -> `--source s`), in the order given. A value may be a placeholder another tool fills
    in (Argo's `{{inputs.parameters.x}}`)."""
    return [a for name, value in given.items() for a in (BY_NAME[name].cli_flag, str(value))]


# ---------------------------------------------------------------- docs/parameters.md
def _literal(value) -> str:
    if value is REQUIRED:
        return "required"
    if value is None:
        return "none"
    if value == "":
        return "empty"
    return f"`{value}`"


def reference_markdown() -> str:
    """docs/parameters.md: one row per parameter, for a reader choosing what to pass."""
    lines = [
        "<!-- Generated by `elastic-step compile` from elastic_step/spec.py; do not edit. -->",
        "# Parameters",
        "",
        "Every parameter of a training job and of the train→evaluate pipeline, with the surfaces that take it:",
        "",
        "- **prep**, **train**, **evaluate**, **run**: the commands `elastic-step data prep`, `elastic-step train`, "
        "`elastic-step evaluate` and `elastic-step pipeline run`, with the flag shown;",
        "- **pipeline**: the KFP pipeline (`elastic_step.pipelines.train_eval`, pipelines/train_eval/), the Argo "
        "WorkflowTemplate (pipelines/argo/, the name with dashes) and `elastic-step schedule create`;",
        "- **component**, **v1**: the KFP components (`elastic_step.components`) and the v1 (Elyra) components "
        "(components/<step>/component.yaml) of the steps named;",
        "- **config**: the master's configuration, `elastic_step.master.api.TrainConfig`.",
        "",
        'A default is the same on every surface. In a pipeline, an empty string is "not set" (the default), '
        "except where the meaning says what empty does.",
        "",
        "| parameter | CLI flag | type | default | meaning | surfaces | steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in PARAMS:
        cli = {PREP, TRAIN, EVAL, RUN, PIPELINE} & p.on or p.steps
        flags = ", ".join(f"`{f}`" for f in (p.cli_flag, *p.aliases)) if cli else ""
        surfaces = ", ".join(SURFACES[s] for s in SURFACES if s in p.on)
        choices = f" One of {', '.join(f'`{c}`' for c in p.choices)}." if p.choices else ""
        lines.append(
            f"| `{p.name}` | {flags} | {p.type.__name__} | {_literal(p.default)} | "
            f"{p.help.replace('|', '/')}.{choices} | {surfaces} | {', '.join(p.steps)} |"
        )
    lines += [
        "",
        "## Flags of one command",
        "",
        "These belong to one command of the CLI, not to the job, so the table above leaves them out:",
        "",
        "| command | flag | meaning |",
        "|---|---|---|",
        "| `data prep` | `--output DIR` (required) | the folder for `train/` and `eval/`, each a manifest and its "
        "shards |",
        "| `train` | `--prepared DIR` | the folder `data prep` wrote: the same as `--train-data DIR/train "
        "--eval-data DIR/eval` |",
        "| `train`, `pipeline run` | `--chaos ACTION:INSTANCE@RECORDS` (repeatable) | testing and the demo: "
        "disturb the job on purpose, e.g. `kill:worker-0@400` SIGKILLs worker-0 once 400 records are committed; "
        "none given, the job reads `ELASTIC_STEP_CHAOS` ([guarantees.md](guarantees.md#fault-injection)) |",
        "| `evaluate` | `--model` (required), `--eval-data` or `--prepared DIR`, `--metrics-out FILE`, "
        "`--passed-out FILE` | the model folder or `model.keras`; the eval manifest (or `DIR/eval`); also write "
        "the result as JSON, and the gate as true/false |",
        "| `publish` | `--model` (required), `--to` (required) | the model folder, and the folder URI to copy it to |",
        "| `pipeline run` | `--json` | print the whole result as JSON instead of the summary for a person |",
        "| `schedule create` | `--host` (required), `--cron` (required), `--experiment` (`elastic-step`), "
        "`--name` (`elastic-step-train-eval-nightly`), `--namespace`, `--service-account`, `--pipeline-root` | "
        "the KFP API endpoint; 6 cron fields, seconds first; the recurring run's experiment, name and namespace; "
        "the runs' service account; where the runs' artifacts go (empty: the cluster's) "
        "([kfp.md](kfp.md#recurring-runs)) |",
        "| `compile` | `--root` (`.`) | the repository root the generated files go to |",
        "| any (before the command: `elastic-step -v train ...`) | `-v`, `--verbose` | debug logging |",
        "| any (before the command) | `--log-format` (`text`) | `json`: one JSON object a line, with the job, the "
        "role and the event's kind, for log shippers (the job's workers and parameter servers log as its master "
        "does) ([observability.md](observability.md#logs)) |",
        "",
        "Adding a parameter: one `Param` in elastic_step/spec.py (a training parameter also needs its "
        "TrainConfig field, a KFP surface its argument in the signature), then `elastic-step compile`; "
        "tests/unit/test_spec.py checks the signatures and TrainConfig against the spec.",
        "",
    ]
    return "\n".join(lines)
