"""`elastic-step pipeline run`: the train→evaluate pipeline on this machine through kfp.local
(SubprocessRunner; the training step uses the local backend), artifacts under OUTPUT."""
from __future__ import annotations

import json
import os
import pathlib
import sys

from elastic_step.errors import ConfigError


def _absolute_if_local(value: str) -> str:
    """Steps run in their own working folder: make a local path the user gave absolute."""
    if "://" not in value and os.path.exists(value):
        return os.path.abspath(value)
    return value


def run_local(source_uri: str, model_def: str, output: str, **params) -> dict:
    from kfp import local

    from elastic_step.pipelines.train_eval import build

    root = pathlib.Path(output).resolve() / "pipeline_root"
    root.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in root.iterdir()}
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    pipeline = build(gate_with_condition=False)  # see build(): kfp.local cannot evaluate dsl.If on outputs
    try:
        pipeline(source_uri=_absolute_if_local(source_uri), model_def=_absolute_if_local(model_def),
                 **{k: v for k, v in params.items() if v is not None})
    except RuntimeError as e:
        raise ConfigError(f"The pipeline run failed: {e}. The failing step's log is above; its files are "
                          f"under {root}.") from None
    runs = [p for p in root.iterdir() if p.name not in before and p.is_dir()]
    if len(runs) != 1:
        raise ConfigError(f"Could not find this run's folder under {root}.")
    return describe_run(runs[0])


def describe_run(run_dir: pathlib.Path) -> dict:
    """Where each artifact went, and the evaluation result, from the run's executor outputs."""
    artifacts, outputs = {}, {}
    for task_dir in sorted(p for p in run_dir.iterdir() if p.is_dir()):
        for item in sorted(task_dir.iterdir()):
            if item.name != "executor_output.json":
                artifacts[f"{task_dir.name}.{item.name}"] = str(item)
        executor_output = task_dir / "executor_output.json"
        if executor_output.exists():
            params = json.loads(executor_output.read_text()).get("parameterValues", {})
            outputs.update({f"{task_dir.name}.{k}": v for k, v in params.items()})
    evaluation = {"score": outputs.get("evaluate-op.score"), "passed": outputs.get("evaluate-op.passed"),
                  "published_to": outputs.get("publish-model-op.Output") or None}
    metrics_path = artifacts.get("evaluate-op.metrics")
    if metrics_path and os.path.isfile(metrics_path):
        evaluation["metrics"] = json.loads(pathlib.Path(metrics_path).read_text() or "{}")
    return {"run": str(run_dir), "evaluation": evaluation, "artifacts": artifacts}


def print_run(result: dict, stream=sys.stderr) -> None:
    stream.write(f"\npipeline run: {result['run']}\n")
    for name, path in result["artifacts"].items():
        stream.write(f"  {name:<40} {path}\n")
    ev = result["evaluation"]
    stream.write(f"evaluation: score {ev['score']} -> {'PASSED' if ev['passed'] else 'did not pass'} the gate"
                 + (f"; published to {ev['published_to']}" if ev.get("published_to") else "") + "\n")
