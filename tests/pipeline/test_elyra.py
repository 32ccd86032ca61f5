"""The drag-in path, read by the real client: Elyra's own KFP component parser (elyra 4.x from PyPI, the
`elyra` extra) reads every shipped v1 components/<name>/component.yaml through a Filesystem Component
Catalog, and the palette and node properties Elyra renders from it show the name, description, inputs
(type, default) and outputs the YAML declares, nothing more, nothing less.

Elyra runs in a child process: importing it starts nothing, but it loads a Jupyter server's modules and
keeps singletons (processor registry, component cache) that must not leak into the rest of the suite.
Its Jupyter data, config and runtime dirs are the test's tmp dir."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

from elastic_step.pipelines.compile import COMPONENTS

ROOT = pathlib.Path(__file__).resolve().parents[2]
V1_FILES = [f"components/{folder}/component.yaml" for folder in COMPONENTS]
CATEGORY = "elastic-step"

# What Elyra's server does for one catalog, minus the HTTP: the catalog is created as
# `elyra-metadata create component-catalogs --schema_name=local-file-catalog` would (validated against
# Elyra's schema, saved in the Jupyter data dir), read by ComponentCache.read_component_catalog (entry
# point local-file-catalog -> FilesystemComponentCatalogConnector -> KfpComponentParser.parse), and
# rendered by the same calls as its /elyra/pipeline/components/... handlers: palette and properties panel.
ELYRA = r"""
import json, sys
from elyra.metadata.manager import MetadataManager
from elyra.metadata.metadata import Metadata
from elyra.pipeline.component_catalog import ComponentCache
from elyra.pipeline.registry import PipelineProcessorRegistry

root, paths, category, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
catalog = MetadataManager(schemaspace="component-catalogs").create("elastic_step", Metadata(
    name="elastic_step", display_name="elastic-step", schema_name="local-file-catalog",
    metadata={"runtime_type": "KUBEFLOW_PIPELINES", "categories": [category], "base_path": root,
              "paths": paths}))
components = ComponentCache.instance().read_component_catalog(catalog)
result = {
    "processors": [p.name for p in PipelineProcessorRegistry.instance().get_all_processors()],
    "catalog_class": type(catalog).__name__,
    "palette": ComponentCache.to_canvas_palette(list(components.values())),
    "components": {c.component_reference["path"]: {
        "id": c.id, "name": c.name, "description": c.description, "runtime_type": c.runtime_type_name,
        "properties": [{"ref": p.ref, "name": p.name, "json_data_type": p.json_data_type, "value": p.value,
                        "allowed_input_types": p.allowed_input_types, "required": p.required,
                        "description": p.description} for p in c.properties],
        "panel": ComponentCache.to_canvas_properties(c)} for c in components.values()},
}
with open(out, "w") as f:
    json.dump(result, f)
"""


@pytest.fixture(scope="module")
def elyra(tmp_path_factory) -> dict:
    if importlib.util.find_spec("elyra") is None:  # found, not imported: it stays out of this process
        pytest.fail("elyra is not installed: run scripts/bootstrap")
    pinned = re.search(r"(?m)^elyra==(\S+)$", (ROOT / "constraints.txt").read_text()).group(1)
    assert importlib.metadata.version("elyra") == pinned and pinned.startswith("4."), "run scripts/bootstrap"
    tmp = tmp_path_factory.mktemp("elyra")
    # none of the caller's Jupyter or Elyra settings (ELYRA_METADATA_PATH, ELYRA_PROCESSOR_RUNTIMES, ...)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "ELYRA_"))}
    env.update(
        JUPYTER_DATA_DIR=str(tmp / "data"),
        JUPYTER_CONFIG_DIR=str(tmp / "config"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
    )
    out = tmp / "elyra.json"
    proc = subprocess.run(
        [sys.executable, "-c", ELYRA, str(ROOT), json.dumps(V1_FILES), CATEGORY, str(out)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    # Without the KFP processor Elyra drops a KFP catalog silently (and offers no pipeline parameters)
    assert "kfp" in result["processors"], proc.stderr[-4000:]
    assert result["catalog_class"] == "FilenameCatalogMetadata"
    assert sorted(result["components"]) == sorted(V1_FILES), proc.stderr[-4000:]
    return result


# How Elyra 4 types a KFP v1 input read by value: (JSON type, widget the user types into, the value
# when the YAML gives no default). Elyra matches substrings of the type's name: "Dataset" holds "set",
# so it is a list, typed in as text and "[]" when empty. A type not listed here fails the test on purpose.
VALUE_TYPES = {
    "String": ("string", "string", str, ""),
    "Integer": ("number", "number", int, 0),
    "Float": ("number", "number", float, 0.0),
    "Boolean": ("boolean", "boolean", lambda v: str(v).lower() == "true", False),
    "Dataset": ("array", "string", str, "[]"),
}
# besides a typed-in value: a parent node's output, a file, a pipeline parameter (the KFP processor has them)
OTHER_SOURCES = ["inputpath", "file", "parameter"]
FROM_ANYWHERE = ["inputvalue", *OTHER_SOURCES]


def path_based(name: str, spec: dict) -> bool:
    """Elyra's rule: an input or output is a path when the first top-level placeholder naming it is an
    xPath one. One nested in `concat` or `if` is not seen."""
    container = spec["implementation"]["container"]
    for item in container.get("command", []) + container.get("args", []):
        if isinstance(item, dict) and name in item.values():
            return "Path" in next(iter(item))
    return False


def expected_properties(spec: dict) -> list[dict]:
    props = []
    for i in spec.get("inputs", []):
        kfp_type, desc = i["type"], i.get("description")
        prop = {
            "ref": i["name"],
            "name": i["name"],
            "required": not i.get("optional", False),
            "description": f"{desc} (type: {kfp_type})" if desc else f"(type: {kfp_type})",
        }
        if path_based(i["name"], spec):  # only a parent node's output
            prop.update(json_data_type="string", value=None, allowed_input_types=["inputpath"])
        else:
            json_type, _, cast, empty = VALUE_TYPES[kfp_type]
            prop.update(
                json_data_type=json_type,
                allowed_input_types=FROM_ANYWHERE,
                value=cast(i["default"]) if "default" in i else empty,
            )
        props.append(prop)
    for o in spec.get("outputs", []):
        assert path_based(o["name"], spec), o  # an output Elyra does not see as a path would be an input
        props.append(
            {
                "ref": f"output_{o['name']}",
                "name": o["name"],
                "required": True,
                "value": "",
                "json_data_type": "string",
                "allowed_input_types": [None],
                "description": o.get("description", ""),
            }
        )
    return props


def panel_sections(panel: dict) -> dict[str, dict]:
    """The node's properties panel, split at its headers: inputs, outputs, Elyra's own additions."""
    sections, current = {"inputs": {}, "outputs": {}, "additional_properties": {}}, None
    for key, value in panel["properties"]["component_parameters"]["properties"].items():
        if key.endswith("_header"):
            current = key[: -len("_header")]
        else:
            sections[current][key] = value
    return sections


def value_entry(field: dict) -> dict:
    """The typed-in-value choice of a value input's field."""
    return next(o for o in field["oneOf"] if o["properties"]["widget"]["default"] not in OTHER_SOURCES)


@pytest.mark.parametrize("rel", V1_FILES)
def test_elyra_parses_the_component_as_declared(elyra, rel):
    spec = yaml.safe_load((ROOT / rel).read_text())
    c = elyra["components"][rel]
    assert (c["name"], c["description"], c["runtime_type"]) == (spec["name"], spec["description"], "KUBEFLOW_PIPELINES")
    assert c["properties"] == expected_properties(spec)  # every input and output, in order, nothing else


@pytest.mark.parametrize("rel", V1_FILES)
def test_the_palette_and_properties_panel_show_the_declared_interface(elyra, rel):
    spec = yaml.safe_load((ROOT / rel).read_text())
    c = elyra["components"][rel]
    (category,) = elyra["palette"]["categories"]
    assert category["label"] == CATEGORY
    (node,) = [n for n in category["node_types"] if n["op"] == c["id"]]
    assert (node["label"], node["description"]) == (spec["name"], spec["description"])

    panel = panel_sections(c["panel"])
    inputs = spec.get("inputs", [])
    assert list(panel["inputs"]) == [i["name"] for i in inputs]
    assert list(panel["outputs"]) == [f"output_{o['name']}" for o in spec.get("outputs", [])]
    assert c["panel"]["properties"]["component_parameters"]["required"] == [
        i["name"] for i in inputs if not i.get("optional")
    ]
    for i in inputs:
        field = panel["inputs"][i["name"]]
        assert field["title"] == i["name"]
        if path_based(i["name"], spec):
            assert field["properties"]["widget"]["default"] == "inputpath" and "oneOf" not in field
            continue
        _, widget, cast, empty = VALUE_TYPES[i["type"]]
        assert [o["properties"]["widget"]["default"] for o in field["oneOf"]] == [widget, *OTHER_SOURCES]
        assert value_entry(field)["properties"]["value"] == {
            "type": widget,
            "default": cast(i["default"]) if "default" in i else empty,
            **({"title": " "} if widget == "boolean" else {}),  # a checkbox: Elyra gives it a blank title
        }
        (param,) = [o for o in field["oneOf"] if o["properties"]["widget"]["default"] == "parameter"]
        assert param["uihints"]["value"] == {"ui:typefilter": i["type"]}  # pipeline parameters of that type
    for o in spec.get("outputs", []):
        field = panel["outputs"][f"output_{o['name']}"]
        assert field["title"] == o["name"] and field["uihints"]["outputpath"] is True


def test_what_a_user_sees_in_the_properties_panels(elyra):
    """Concrete values, not derived from the YAML: what a person reads on the nodes, the training one most."""
    c = elyra["components"]["components/elastic_train/component.yaml"]
    panel = panel_sections(c["panel"])
    assert c["name"] == "elastic-step train"
    epochs = panel["inputs"]["epochs"]
    assert epochs["description"] == "passes over the training data (type: Integer)"
    assert value_entry(epochs)["title"] == "Please enter a number value:"
    assert value_entry(epochs)["properties"]["value"] == {"type": "number", "default": 1}
    assert value_entry(panel["inputs"]["strategy"])["properties"]["value"] == {"type": "string", "default": "ps"}
    required = c["panel"]["properties"]["component_parameters"]["required"]
    assert "epochs" in required and "model_def" in required and "worker_image" not in required
    assert list(panel["outputs"]) == ["output_model"]
    # `prepared` stands alone as an inputPath (`--prepared DIR`), so Elyra offers only the data prep
    # node's output for it: no text field to type a path into. (Inside a `concat`, which Elyra's path
    # check does not look into, it was a text field pre-filled with "[]", "Dataset" typing as a list.)
    prepared = panel["inputs"]["prepared"]
    assert prepared["properties"]["widget"]["default"] == "inputpath" and "oneOf" not in prepared
    assert prepared["uihints"]["value"] == {"inputpath": True}
    # evaluate's `model` is a top-level inputPath: only a parent node's output can feed it
    model = panel_sections(elyra["components"]["components/evaluate/component.yaml"]["panel"])["inputs"]["model"]
    assert model["properties"]["widget"]["default"] == "inputpath" and model["uihints"]["value"] == {"inputpath": True}
    data_prep = panel_sections(elyra["components"]["components/data_prep/component.yaml"]["panel"])
    assert value_entry(data_prep["inputs"]["eval_fraction"])["properties"]["value"] == {
        "type": "number",
        "default": 0.2,
    }
    assert list(data_prep["outputs"]) == ["output_prepared"]
