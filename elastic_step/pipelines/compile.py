"""`elastic-step compile`: the uploadable files, regenerated from the Python definitions.

- components/<name>/<name>.yaml: KFP IR (upload to the KFP UI; runs as a one-step pipeline),
- components/<name>/component.yaml: a v1 component whose container runs the `elastic-step` CLI
  (Elyra's visual editor reads this format),
- pipelines/train_eval/train_eval.yaml: the train→evaluate pipeline's IR.
A test recompiles into a temporary folder and fails when a committed file is stale.
"""
from __future__ import annotations

import pathlib

import yaml

from elastic_step.util.atomic import atomic_write_text

# folder -> {file stem: component}; the *_uri variants are for the KFP UI, which cannot pass artifacts
COMPONENTS = {"data_prep": {"data_prep": "data_prep_op"},
              "elastic_train": {"elastic_train": "elastic_train_op", "elastic_train_uri": "elastic_train_uri_op"},
              "evaluate": {"evaluate": "evaluate_op", "evaluate_uri": "evaluate_uri_op"},
              "publish_model": {"publish_model": "publish_model_op"}}


def _v1(image: str) -> dict[str, dict]:
    """v1 component specs (for Elyra): the same steps, through the CLI."""
    return {
        "data_prep": {
            "name": "elastic-step data prep",
            "description": "CSV / Parquet / JSON lines at any fsspec URI -> validated Parquet shards; "
                           "the output folder holds train/ and eval/, each with a manifest.json.",
            "inputs": [{"name": "source_uri", "type": "String"},
                       {"name": "label", "type": "String", "default": "label"},
                       {"name": "eval_fraction", "type": "Float", "default": "0.2"}],
            "outputs": [{"name": "prepared", "type": "Dataset"}],
            "implementation": {"container": {"image": image, "command": [
                "elastic-step", "data", "prep", "--source", {"inputValue": "source_uri"},
                "--label", {"inputValue": "label"}, "--eval-fraction", {"inputValue": "eval_fraction"},
                "--output", {"outputPath": "prepared"}]}}},
        "elastic_train": {
            "name": "elastic-step train",
            "description": "Elastic TensorFlow training: workers and parameter servers that survive "
                           "preemption; writes model.keras, saved_model/, summary.json and report.html.",
            "inputs": [{"name": "prepared", "type": "Dataset"}, {"name": "model_def", "type": "String"},
                       {"name": "epochs", "type": "Integer", "default": "5"},
                       {"name": "min_workers", "type": "Integer", "default": "1"},
                       {"name": "max_workers", "type": "Integer", "default": "2"},
                       {"name": "num_ps", "type": "Integer", "default": "1"},
                       {"name": "backend", "type": "String", "default": "local"}],
            "outputs": [{"name": "model", "type": "Model"}],
            "implementation": {"container": {"image": image, "command": [
                "elastic-step", "train", "--model-def", {"inputValue": "model_def"},
                "--train-data", {"concat": [{"inputPath": "prepared"}, "/train"]},
                "--eval-data", {"concat": [{"inputPath": "prepared"}, "/eval"]},
                "--epochs", {"inputValue": "epochs"}, "--min-workers", {"inputValue": "min_workers"},
                "--max-workers", {"inputValue": "max_workers"}, "--num-ps", {"inputValue": "num_ps"},
                "--backend", {"inputValue": "backend"}, "--output", {"outputPath": "model"}]}}},
        "evaluate": {
            "name": "elastic-step evaluate",
            "description": "Evaluate a trained model on the eval split; the JSON result says whether it "
                           "passed the threshold.",
            "inputs": [{"name": "model", "type": "Model"}, {"name": "prepared", "type": "Dataset"},
                       {"name": "model_def", "type": "String"},
                       {"name": "threshold", "type": "Float", "default": "0.9"},
                       {"name": "metric", "type": "String", "default": "accuracy"}],
            "outputs": [{"name": "result", "type": "JsonObject"}],
            "implementation": {"container": {"image": image, "command": [
                "elastic-step", "evaluate", "--model", {"inputPath": "model"},
                "--eval-data", {"concat": [{"inputPath": "prepared"}, "/eval"]},
                "--model-def", {"inputValue": "model_def"}, "--threshold", {"inputValue": "threshold"},
                "--metric", {"inputValue": "metric"}, "--metrics-out", {"outputPath": "result"}]}}},
    }


def compile_all(root: str = ".") -> list[str]:
    from kfp import compiler

    import elastic_step.components as components
    from elastic_step.pipelines.train_eval import train_eval

    base = pathlib.Path(root)
    written = []
    for folder, stems in COMPONENTS.items():
        for stem, attr in stems.items():
            path = base / "components" / folder / f"{stem}.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            compiler.Compiler().compile(getattr(components, attr), str(path))
            written.append(str(path))
    for folder, spec in _v1(components.BASE_IMAGE).items():
        path = base / "components" / folder / "component.yaml"
        atomic_write_text(str(path), "# Generated by `elastic-step compile`: a v1 component for Elyra.\n"
                          + yaml.safe_dump(spec, sort_keys=False, width=110))
        written.append(str(path))
    path = base / "pipelines" / "train_eval" / "train_eval.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(train_eval, str(path))
    written.append(str(path))
    return written
