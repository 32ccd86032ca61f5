"""The KFP components and pipeline: compiled files current, loadable, composable; and the whole
pipeline run for real through kfp.local (SubprocessRunner, real TensorFlow training).

No `from __future__ import annotations`: KFP reads the pipeline functions' real types."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml
from kfp import compiler, dsl
from kfp.components import load_component_from_file

from elastic_step.pipelines.compile import compile_all

ROOT = pathlib.Path(__file__).resolve().parents[2]
VERSION = re.compile(r"(kfp-|elastic-step:)\d[\w.\-]*")


def normalised(path: pathlib.Path):
    """The YAML documents with version strings blanked: a golden compare ignores only those. Parsed,
    not text: another library's YAML representers (Hera registers some) change quoting, not content."""
    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items()}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return VERSION.sub(r"\1<version>", node) if isinstance(node, str) else node
    return [strip(doc) for doc in yaml.safe_load_all(path.read_text())]


def test_compiled_files_are_current(tmp_path):
    fresh = compile_all(str(tmp_path))
    assert len(fresh) >= 8
    for path in fresh:
        rel = pathlib.Path(path).relative_to(tmp_path)
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is missing: run `elastic-step compile` and commit"
        assert normalised(committed) == normalised(pathlib.Path(path)), \
            f"{rel} is stale: run `elastic-step compile` and commit"


def test_ir_components_load_back_and_compose(tmp_path):
    prep = load_component_from_file(str(ROOT / "components/data_prep/data_prep.yaml"))
    train = load_component_from_file(str(ROOT / "components/elastic_train/elastic_train.yaml"))
    evaluate = load_component_from_file(str(ROOT / "components/evaluate/evaluate.yaml"))

    @dsl.pipeline(name="from-uploaded-components")
    def p(source_uri: str, model_def: str):
        d = prep(source_uri=source_uri, label="label")
        t = train(train_data=d.outputs["train_data"], eval_data=d.outputs["eval_data"], model_def=model_def,
                  max_workers=4)
        evaluate(model=t.outputs["model"], eval_data=d.outputs["eval_data"], model_def=model_def, threshold=0.8)

    out = tmp_path / "p.yaml"
    compiler.Compiler().compile(p, str(out))
    text = out.read_text()
    for name in ("data-prep-op", "elastic-train-op", "evaluate-op"):
        assert name in text


def test_v1_components_for_elyra_load():
    for name in ("data_prep", "elastic_train", "evaluate"):
        component = load_component_from_file(str(ROOT / "components" / name / "component.yaml"))
        assert component.component_spec.implementation.container.command[0] == "elastic-step"


def test_pipeline_yaml_has_the_gate():
    text = (ROOT / "pipelines/train_eval/train_eval.yaml").read_text()
    assert "condition-gate-passed" in text or "gate-passed" in text
    assert "triggerPolicy" in text and "passed" in text


def run_pipeline(tmp_path, *extra, env=None):
    return subprocess.run([sys.executable, "-m", "elastic_step.cli", "pipeline", "run", "--source",
                           "samples/digits/digits.csv", "--model-def", "samples/digits/model.py", "--label", "label",
                           "--output", str(tmp_path / "run"), "--publish-uri", str(tmp_path / "published"), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_pipeline_runs_locally_and_passes_the_gate(tmp_path):
    proc = run_pipeline(tmp_path, "--epochs", "10")
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["evaluation"]["passed"] is True
    assert result["evaluation"]["score"] >= 0.90
    assert (tmp_path / "published" / "model.keras").is_file()
    assert (tmp_path / "published" / "saved_model" / "saved_model.pb").is_file()
    for artifact in ("data-prep-op.train_data", "elastic-train-op.model", "elastic-train-op.report",
                     "elastic-train-op.summary"):
        assert os.path.exists(result["artifacts"][artifact]), artifact
    assert "PASSED the gate" in proc.stderr


@pytest.mark.slow
def test_pipeline_survives_a_killed_worker(tmp_path):
    proc = run_pipeline(tmp_path, "--epochs", "30", "--minibatch-size", "32",
                        env={"ELASTIC_STEP_CHAOS": "kill:worker-0@6000"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    summary = json.loads(pathlib.Path(result["artifacts"]["elastic-train-op.summary"]).read_text())
    assert summary["workers"]["lost"] >= 1 and summary["workers"]["relaunched"] >= 1
    assert all(e["lost"] == 0 and e["double_applied"] == 0 and e["committed"] == e["records"]
               for e in summary["ledger"]["epochs"])
    report = pathlib.Path(result["artifacts"]["elastic-train-op.report"]).read_text()
    assert "worker-0 lost" in report
    assert result["evaluation"]["passed"] is True


def test_ui_uploadable_components_take_only_strings_and_numbers():
    """The KFP UI starts an uploaded component as a one-step pipeline: every input must be a parameter."""
    for rel in ("components/data_prep/data_prep.yaml", "components/elastic_train/elastic_train_uri.yaml",
                "components/evaluate/evaluate_uri.yaml", "pipelines/train_eval/train_eval.yaml"):
        spec = yaml.safe_load((ROOT / rel).read_text())
        inputs = spec["root"].get("inputDefinitions", {})
        assert "artifacts" not in inputs, rel
        assert {p["parameterType"] for p in inputs["parameters"].values()} <= {"STRING", "NUMBER_INTEGER",
                                                                               "NUMBER_DOUBLE", "BOOLEAN"}, rel
