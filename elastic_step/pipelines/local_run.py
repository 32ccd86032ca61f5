"""`elastic-step pipeline run`: the train→evaluate pipeline on this machine through kfp.local
(SubprocessRunner in this Python environment; the training step uses the local backend), with the
pipeline root, and so every artifact, under OUTPUT/pipeline_root/<run>/<task>/<output>.

It runs the very pipeline that is compiled for a cluster, `dsl.If` gate included (see
kfp_local_compat for the one kfp.local gap this needs closed).

The steps run as subprocesses that inherit this process's environment, which is how a run reaches
the training step: ELASTIC_STEP_CHAOS (`--chaos`) disturbs it on purpose, and AIP_TENSORBOARD_LOG_DIR
gets its TensorBoard event files out of it. That is Vertex AI's variable for the same thing; here the
run plays Vertex's part, pointing it at OUTPUT/tensorboard/<run> unless the caller set it already.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
import time

from elastic_step.errors import ConfigError
from elastic_step.faults.chaos import ENV as CHAOS_ENV
from elastic_step.faults.chaos import specs as chaos_specs
from elastic_step.master.observe.goodput import describe as describe_goodput
from elastic_step.master.tensorboard import VERTEX_LOG_DIR_ENV

# task names in the compiled pipeline (KFP derives them from the component names)
PREP, TRAIN, EVALUATE, PUBLISH = "data-prep-op", "elastic-train-op", "evaluate-op", "publish-model-op"


def _absolute_if_local(value: str) -> str:
    """Steps run in their own working folder: make a local path the user gave absolute."""
    if value and "://" not in value and os.path.exists(value):
        return os.path.abspath(value)
    return value


def _absolute_destination(value: str) -> str:
    """A local publish destination, relative to where the user ran the command."""
    if value and "://" not in value:
        return os.path.abspath(value)
    return value


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """Set variables for the steps of this run, and put the caller's environment back afterwards."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _tensorboard_dir(output: str) -> str:
    """A fresh folder per run under OUTPUT/tensorboard, so `tensorboard --logdir OUTPUT/tensorboard`
    shows each run as its own line."""
    base = pathlib.Path(output).resolve() / "tensorboard"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, n = base / stamp, 1
    while candidate.exists():
        n += 1
        candidate = base / f"{stamp}-{n}"
    return str(candidate)


def run_local(source_uri: str, model_def: str, output: str, chaos: list[str] | None = None, **params) -> dict:
    """Run the pipeline; `chaos`: fault-injection specs for the training step (see faults/chaos.py),
    e.g. ["kill:worker-0@300000"]. Returns what describe_run finds, plus the gate, the chaos asked for
    and the TensorBoard folder."""
    from kfp import local

    from elastic_step.pipelines import kfp_local_compat
    from elastic_step.pipelines.train_eval import train_eval

    if not kfp_local_compat.install():
        raise ConfigError(
            "This kfp version's local runner cannot evaluate the pipeline's gate (dsl.If on "
            "evaluate's `passed`); elastic-step supports kfp 2.17."
        )
    root = pathlib.Path(output).resolve() / "pipeline_root"
    root.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in root.iterdir()}
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    args = {k: v for k, v in params.items() if v is not None}
    if "publish_uri" in args:
        args["publish_uri"] = _absolute_destination(args["publish_uri"])
    env = {VERTEX_LOG_DIR_ENV: os.environ.get(VERTEX_LOG_DIR_ENV) or _tensorboard_dir(output)}
    if chaos:
        env[CHAOS_ENV] = ",".join(chaos)
    requested_chaos = list(chaos_specs(chaos or ()))
    try:
        with _environment(env):
            train_eval(source_uri=_absolute_if_local(source_uri), model_def=_absolute_if_local(model_def), **args)
    except RuntimeError as e:
        raise ConfigError(
            f"The pipeline run failed: {e}. The failing step's log is above; its files are under {root}."
        ) from None
    runs = [p for p in root.iterdir() if p.name not in before and p.is_dir()]
    if len(runs) != 1:
        raise ConfigError(f"Could not find this run's folder under {root}.")
    result = describe_run(runs[0])
    result.update(
        gate={"metric": args.get("metric", "accuracy"), "threshold": args.get("threshold", 0.9)},
        chaos=requested_chaos,
        tensorboard=env[VERTEX_LOG_DIR_ENV],
    )
    return result


def describe_run(run_dir: pathlib.Path) -> dict:
    """Where each artifact went, the training and evaluation figures and the gate's outcome, from the
    run's folder: one folder per task that ran, with its executor_output.json (output parameters, and
    each output artifact's URI and metadata; Metrics and ClassificationMetrics live only there)."""
    artifacts, metadata, outputs = {}, {}, {}
    tasks = sorted(p for p in run_dir.iterdir() if p.is_dir())
    for task_dir in tasks:
        executor_output = task_dir / "executor_output.json"
        record = json.loads(executor_output.read_text()) if executor_output.exists() else {}
        outputs.update({f"{task_dir.name}.{k}": v for k, v in record.get("parameterValues", {}).items()})
        for name, listed in sorted(record.get("artifacts", {}).items()):
            for artifact in listed.get("artifacts", []):
                key = f"{task_dir.name}.{name}"
                uri = artifact.get("uri", "")
                artifacts[key] = uri if os.path.exists(uri) else str(executor_output)
                if artifact.get("metadata"):
                    metadata[key] = artifact["metadata"]
    ran = {t.name for t in tasks}
    evaluation = {
        "score": outputs.get(f"{EVALUATE}.score"),
        "passed": outputs.get(f"{EVALUATE}.passed"),
        "metrics": metadata.get(f"{EVALUATE}.metrics", {}),
    }
    if PUBLISH in ran:
        published_to = outputs.get(f"{PUBLISH}.Output") or None
        publish = {"ran": True, "published_to": published_to}
        if not published_to:
            publish["note"] = "no --publish-uri given: nothing copied"
    else:
        publish = {"ran": False, "published_to": None, "note": "skipped: the model did not pass the gate"}
    return {
        "run": str(run_dir),
        "tasks": sorted(ran),
        "training": metadata.get(f"{TRAIN}.metrics", {}),
        "evaluation": evaluation,
        "publish": publish,
        "artifacts": artifacts,
        "metadata": metadata,
    }


def print_run(result: dict, stream=None) -> None:
    stream = stream or sys.stderr  # looked up now: whatever stderr is at the time of the call
    stream.write(f"\npipeline run: {result['run']}\n")
    for name, path in result["artifacts"].items():
        stream.write(f"  {name:<40} {path}\n")
    ev, pub, tr = result["evaluation"], result["publish"], result.get("training") or {}
    if tr:
        evals = ", ".join(f"{k[5:]} {v:.4g}" for k, v in tr.items() if k.startswith("eval_") and k != "eval_records")
        stream.write(
            f"training: {evals}; {tr.get('throughput_records_per_s', 0):.0f} records/s; workers lost "
            f"{tr.get('workers_lost', 0):.0f}, relaunched {tr.get('workers_relaunched', 0):.0f}\n"
        )
    verdict = "PASSED the gate" if ev["passed"] else "did NOT pass the gate"
    if "threshold" in (ev.get("metrics") or {}):
        verdict += f" (threshold {ev['metrics']['threshold']:g})"
    metrics = ", ".join(
        f"{k} {v:.4g}"
        for k, v in (ev.get("metrics") or {}).items()
        if isinstance(v, (int, float)) and k not in ("passed", "threshold")
    )
    score = f"{ev['score']:.4f}" if isinstance(ev.get("score"), (int, float)) else ev.get("score")
    stream.write(f"evaluation: score {score} -> {verdict}" + (f" ({metrics})" if metrics else "") + "\n")
    if pub.get("published_to"):
        stream.write(f"published: {pub['published_to']}\n")
    else:
        stream.write(f"publish: {pub.get('note', 'nothing copied')}\n")


def summary_text(result: dict) -> str:
    """The end of a run, for a person: accuracy, the gate, what training did (records, workers lost
    and rejoined, the exactly-once audit) and where to look next. From run_local's result and the
    training step's summary.json."""
    ev, pub, gate = result["evaluation"], result["publish"], result.get("gate") or {}
    metrics = ev.get("metrics") or {}
    summary = _training_summary(result)
    lines = [f"Pipeline run finished: {result['run']}"]

    def row(name: str, text: str) -> None:
        lines.append(f"  {name:<13} {text}")

    if isinstance(metrics.get("accuracy"), (int, float)):
        records = metrics.get("records")
        row("accuracy", f"{metrics['accuracy']:.4f}" + (f" on {records:,.0f} eval records" if records else ""))
    metric, threshold = gate.get("metric", "accuracy"), gate.get("threshold", metrics.get("threshold"))
    score = f"{ev['score']:.4f}" if isinstance(ev.get("score"), (int, float)) else "unknown"
    passed = "PASSED" if ev.get("passed") else "NOT passed"
    gate_text = (
        f"{metric} {score} >= {threshold:g}: {passed}"
        if isinstance(threshold, (int, float))
        else f"{metric} {score}: {passed}"
    )
    if pub.get("published_to"):
        gate_text += f"; model published to {pub['published_to']}"
    else:
        gate_text += f"; model not published ({pub.get('note', 'nothing copied')})"
    row("gate", gate_text)

    if summary is None:
        row("training", "no summary.json from the training step")
    else:
        ledger, workers = summary.get("ledger", {}), summary.get("workers", {})
        trained = (
            f"{ledger.get('records_committed', 0):,} records ({summary.get('epochs', '?')} epochs of "
            f"{summary.get('records_per_epoch', 0):,})"
        )
        if summary.get("training_seconds"):
            trained += f" in {summary['training_seconds']:.1f} s"
            if summary.get("startup_seconds"):
                trained += f" ({summary['startup_seconds']:.1f} s of it starting the PS and workers)"
        if summary.get("throughput_records_per_s"):
            trained += f", {summary['throughput_records_per_s']:,.0f} records/s"
        row("training", trained)
        if summary.get("goodput"):
            row("goodput", describe_goodput(summary["goodput"]))
        row("workers", _workers_text(summary, workers))
        row("exactly-once", _audit_text(summary.get("audit")))
    row("report", result["artifacts"].get(f"{TRAIN}.report", "none"))
    if result.get("tensorboard"):
        row("tensorboard", f"{result['tensorboard']}  (tensorboard --logdir {result['tensorboard']})")
    row("summary", result["artifacts"].get(f"{TRAIN}.summary", "none"))
    lines.append("  (every artifact, and all of this as JSON: --json)")
    return "\n".join(lines) + "\n"


def _training_summary(result: dict) -> dict | None:
    path = result["artifacts"].get(f"{TRAIN}.summary")
    try:
        return json.loads(pathlib.Path(path).read_text()) if path else None
    except (OSError, ValueError):
        return None


def _workers_text(summary: dict, workers: dict) -> str:
    lost = workers.get("lost", 0)
    # A replacement has rejoined once it committed training: the recovery figures count exactly those.
    rejoined = len(summary.get("recovery", {}).get("first_commit_after_loss_s", []))
    text = f"{workers.get('max_alive', 0)} at most; {lost} lost, {rejoined} rejoined"
    chaos = summary.get("chaos")
    if chaos:
        fired = chaos.get("fired", [])
        if fired:
            text += "; lost on purpose (chaos): " + ", ".join(
                f"{f.get('action', 'kill')} {f.get('instance')} at {f.get('at_records', 0):,} records" for f in fired
            )
        for planned in chaos.get("not_fired", []):
            text += f"; chaos {planned.get('action')} at {planned.get('at_records', 0):,} records NEVER fired"
    return text


def _audit_text(audit: dict | None) -> str:
    if not audit or "verdict" not in audit:
        return "audit not available (the training step's summary has none)"
    from elastic_step.master.durability.audit import UNAVAILABLE, describe

    if audit["verdict"] == UNAVAILABLE:
        return f"audit not available ({audit.get('reason', 'no evidence')})"
    try:
        return describe(audit)  # "audit exact: ..." or "audit VIOLATED: ..."
    except (KeyError, TypeError):  # an audit of another shape: its verdict is still worth showing
        return f"audit {audit['verdict']}"
