"""`elastic-step pipeline run`: the train→evaluate pipeline on this machine through kfp.local
(SubprocessRunner in this Python environment; the training step uses the local backend), with the
pipeline root, and so every artifact, under OUTPUT/pipeline_root/<run>/<task>/<output>.

It runs the very pipeline that is compiled for a cluster, `dsl.If` gate included (see
kfp_local_compat for the one kfp.local gap this needs closed).
"""
from __future__ import annotations

import json
import os
import pathlib
import sys

from elastic_step.errors import ConfigError

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


def run_local(source_uri: str, model_def: str, output: str, **params) -> dict:
    from kfp import local

    from elastic_step.pipelines import kfp_local_compat
    from elastic_step.pipelines.train_eval import train_eval

    if not kfp_local_compat.install():
        raise ConfigError("This kfp version's local runner cannot evaluate the pipeline's gate (dsl.If on "
                          "evaluate's `passed`); elastic-step supports kfp 2.17.")
    root = pathlib.Path(output).resolve() / "pipeline_root"
    root.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in root.iterdir()}
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    args = {k: v for k, v in params.items() if v is not None}
    if "publish_uri" in args:
        args["publish_uri"] = _absolute_destination(args["publish_uri"])
    try:
        train_eval(source_uri=_absolute_if_local(source_uri), model_def=_absolute_if_local(model_def), **args)
    except RuntimeError as e:
        raise ConfigError(f"The pipeline run failed: {e}. The failing step's log is above; its files are "
                          f"under {root}.") from None
    runs = [p for p in root.iterdir() if p.name not in before and p.is_dir()]
    if len(runs) != 1:
        raise ConfigError(f"Could not find this run's folder under {root}.")
    return describe_run(runs[0])


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
    evaluation = {"score": outputs.get(f"{EVALUATE}.score"), "passed": outputs.get(f"{EVALUATE}.passed"),
                  "metrics": metadata.get(f"{EVALUATE}.metrics", {})}
    if PUBLISH in ran:
        published_to = outputs.get(f"{PUBLISH}.Output") or None
        publish = {"ran": True, "published_to": published_to}
        if not published_to:
            publish["note"] = "no --publish-uri given: nothing copied"
    else:
        publish = {"ran": False, "published_to": None, "note": "skipped: the model did not pass the gate"}
    return {"run": str(run_dir), "tasks": sorted(ran), "training": metadata.get(f"{TRAIN}.metrics", {}),
            "evaluation": evaluation, "publish": publish, "artifacts": artifacts, "metadata": metadata}


def print_run(result: dict, stream=sys.stderr) -> None:
    stream.write(f"\npipeline run: {result['run']}\n")
    for name, path in result["artifacts"].items():
        stream.write(f"  {name:<40} {path}\n")
    ev, pub, tr = result["evaluation"], result["publish"], result.get("training") or {}
    if tr:
        evals = ", ".join(f"{k[5:]} {v:.4g}" for k, v in tr.items() if k.startswith("eval_") and k != "eval_records")
        stream.write(f"training: {evals}; {tr.get('throughput_records_per_s', 0):.0f} records/s; workers lost "
                     f"{tr.get('workers_lost', 0):.0f}, relaunched {tr.get('workers_relaunched', 0):.0f}\n")
    verdict = "PASSED the gate" if ev["passed"] else "did NOT pass the gate"
    if "threshold" in (ev.get("metrics") or {}):
        verdict += f" (threshold {ev['metrics']['threshold']:g})"
    metrics = ", ".join(f"{k} {v:.4g}" for k, v in (ev.get("metrics") or {}).items()
                        if isinstance(v, (int, float)) and k not in ("passed", "threshold"))
    score = f"{ev['score']:.4f}" if isinstance(ev.get("score"), (int, float)) else ev.get("score")
    stream.write(f"evaluation: score {score} -> {verdict}" + (f" ({metrics})" if metrics else "") + "\n")
    if pub.get("published_to"):
        stream.write(f"published: {pub['published_to']}\n")
    else:
        stream.write(f"publish: {pub.get('note', 'nothing copied')}\n")
