"""The Argo Workflows files: current, valid against Argo's own JSON schema, and every key known to
the schema where it stands (the schema allows unknown keys, so a typo would pass validation)."""
from __future__ import annotations

import copy
import json
import pathlib

import jsonschema
import pytest
import yaml

from elastic_step.argo import render

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT.parent / "shared" / "argo" / "schema.json").read_text())
DEFS = SCHEMA["definitions"]
KINDS = {"WorkflowTemplate": "io.argoproj.workflow.v1alpha1.WorkflowTemplate",
         "CronWorkflow": "io.argoproj.workflow.v1alpha1.CronWorkflow"}
FILES = ["train-eval-template.yaml", "train-eval-cron.yaml"]


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "pipelines" / "argo" / name).read_text())


def resolve(node: dict) -> dict:
    while "$ref" in node:
        node = DEFS[node["$ref"].rsplit("/", 1)[-1]]
    return node


def unknown_keys(doc, node: dict, path: str = "") -> list[str]:
    """Keys of `doc` that the schema does not define at their position."""
    node = resolve(node)
    out = []
    if isinstance(doc, dict):
        props = node.get("properties")
        if props is not None:
            for key, value in doc.items():
                if key not in props:
                    out.append(f"{path}.{key}")
                else:
                    out += unknown_keys(value, props[key], f"{path}.{key}")
        elif isinstance(node.get("additionalProperties"), dict):
            for key, value in doc.items():
                out += unknown_keys(value, node["additionalProperties"], f"{path}.{key}")
    elif isinstance(doc, list) and isinstance(node.get("items"), dict):
        for i, value in enumerate(doc):
            out += unknown_keys(value, node["items"], f"{path}[{i}]")
    return out


def check(doc: dict) -> list[str]:
    kind = KINDS[doc["kind"]]
    validator = jsonschema.Draft7Validator({"$ref": f"#/definitions/{kind}", "definitions": DEFS})
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
    return errors + [f"unknown key {k}" for k in unknown_keys(doc, DEFS[kind])]


def test_rendered_files_are_current(tmp_path):
    for path in render(str(tmp_path)):
        name = pathlib.Path(path).name
        assert (ROOT / "pipelines" / "argo" / name).read_text() == pathlib.Path(path).read_text(), \
            f"pipelines/argo/{name} is stale: run `python -m elastic_step.argo` and commit"


@pytest.mark.parametrize("name", FILES)
def test_valid_against_argo_schema_with_strict_keys(name):
    assert check(load(name)) == []


def test_the_dag_and_the_gate():
    doc = load("train-eval-template.yaml")
    dag = next(t for t in doc["spec"]["templates"] if "dag" in t)["dag"]["tasks"]
    by_name = {t["name"]: t for t in dag}
    assert set(by_name) == {"data-prep", "elastic-train", "evaluate", "publish"}
    assert by_name["publish"]["when"] == "{{tasks.evaluate.outputs.parameters.passed}} == true"
    for t in doc["spec"]["templates"]:
        if "container" in t:
            assert t["container"]["command"] == ["elastic-step"]
    cron = load("train-eval-cron.yaml")["spec"]
    assert cron["schedules"] and "schedule" not in cron and cron["concurrencyPolicy"] == "Forbid"
    assert cron["workflowSpec"]["workflowTemplateRef"]["name"] == doc["metadata"]["name"]


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["spec"].__setitem__("concurrencyPolicyy", d["spec"].pop("concurrencyPolicy")),
     "unknown key .spec.concurrencyPolicyy"),
    (lambda d: d["spec"].__setitem__("schedule", d["spec"].pop("schedules")[0]), "unknown key .spec.schedule"),
    (lambda d: d["spec"]["workflowSpec"]["workflowTemplateRef"].__setitem__("nmae", "x"),
     "unknown key .spec.workflowSpec.workflowTemplateRef.nmae"),
])
def test_a_typo_in_a_key_is_caught(mutate, expected):
    doc = copy.deepcopy(load("train-eval-cron.yaml"))
    mutate(doc)
    assert expected in check(doc)


def test_a_typo_deep_in_a_template_is_caught():
    doc = copy.deepcopy(load("train-eval-template.yaml"))
    container = next(t for t in doc["spec"]["templates"] if "container" in t)["container"]
    container["comand"] = container.pop("command")
    assert any(e.endswith(".container.comand") for e in check(doc))
