"""The KFP components and the pipeline: compiled files current, loadable, composable, documented;
the v1 (Elyra) components run commands the real CLI accepts.

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

from elastic_step.cli import build_parser
from elastic_step.components import DEFAULT_IMAGE
from elastic_step.master import health
from elastic_step.pipelines.compile import COMPONENTS, PARAMETERS_DOC, PIPELINES, compile_all

ROOT = pathlib.Path(__file__).resolve().parents[2]
VERSION = re.compile(r"(kfp-|elastic-step:)\d[\w.\-]*")
PIPELINE_FILE = ROOT / "pipelines/train_eval/train_eval.yaml"
IR_FILES = [f"components/{folder}/{stem}.yaml" for folder, stems in COMPONENTS.items() for stem in stems]
V1_FILES = [f"components/{folder}/component.yaml" for folder in COMPONENTS]
NOT_COMPILED = {"components/elastic_train/rbac.yaml", "pipelines/argo/rbac.yaml"}  # hand-written, beside them


def normalised(path: pathlib.Path):
    """The YAML documents with version strings blanked (sdkVersion kfp-X, the image tag): a golden
    compare ignores only those. Parsed, not text: another library's YAML representers (Hera registers
    some) change quoting, not content."""

    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items()}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return VERSION.sub(r"\1<version>", node) if isinstance(node, str) else node

    return [strip(doc) for doc in yaml.safe_load_all(path.read_text())]


def kfp_pipeline() -> tuple[dict, dict]:
    """The compiled KFP pipeline: its IR and its platform config (the second document: {} when it has none)."""
    spec, *platform = yaml.safe_load_all(PIPELINE_FILE.read_text())
    return spec, (platform[0] if platform else {})


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("compiled")
    compile_all(str(out))
    return out


def test_compiled_files_are_current(fresh):
    """Every file `elastic-step compile` writes: the KFP and v1 components, the KFP pipeline, the Argo
    workflows and docs/parameters.md."""
    generated = sorted(str(p.relative_to(fresh)) for p in fresh.rglob("*") if p.is_file())
    assert set(IR_FILES + V1_FILES) <= set(generated)
    assert {
        f"pipelines/{next(iter(PIPELINES))}/train_eval.yaml",
        "pipelines/argo/train-eval-template.yaml",
        "pipelines/argo/train-eval-cron.yaml",
        PARAMETERS_DOC,
    } <= set(generated)
    for rel in generated:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is missing: run `elastic-step compile` and commit"
        if rel.endswith(".yaml"):
            assert normalised(committed) == normalised(fresh / rel), f"{rel} is stale: run `elastic-step compile`"
        else:
            assert committed.read_text() == (fresh / rel).read_text(), f"{rel} is stale: run `elastic-step compile`"
        # its header (a YAML's first line, the doc's comment) names the Python source it is compiled from
        header = next(line for line in committed.read_text().splitlines() if line.startswith(("# ", "<!--")))
        assert re.search(r"(compile|Generated).* from elastic_step/\S+\.py", header), (rel, header)
    # and nothing compiled is left over from an older layout
    committed_yaml = {str(p.relative_to(ROOT)) for d in ("components", "pipelines") for p in (ROOT / d).rglob("*.yaml")}
    assert committed_yaml - NOT_COMPILED - set(generated) == set(), "a committed YAML that compile no longer writes"


def test_compile_is_deterministic(fresh, tmp_path):
    compile_all(str(tmp_path))
    for p in (p for p in fresh.rglob("*") if p.is_file()):
        assert (tmp_path / p.relative_to(fresh)).read_bytes() == p.read_bytes(), p


def test_golden_compare_ignores_only_version_strings(tmp_path):
    committed = ROOT / "components/evaluate/evaluate.yaml"
    bumped = tmp_path / "bumped.yaml"
    bumped.write_text(
        committed.read_text().replace("kfp-2.17.0", "kfp-2.17.9").replace("elastic-step:0.1.0", "elastic-step:0.2.0")
    )
    assert normalised(bumped) == normalised(committed)
    changed = tmp_path / "changed.yaml"
    changed.write_text(committed.read_text().replace("defaultValue: 0.9", "defaultValue: 0.8"))
    assert normalised(changed) != normalised(committed)


def test_components_run_on_the_runtime_image_without_installing_kfp():
    for rel in IR_FILES + V1_FILES:
        text = (ROOT / rel).read_text()
        assert f"image: {DEFAULT_IMAGE}" in text, rel
        assert "pip install" not in text, rel  # the image ships kfp and elastic_step


def test_ir_components_load_back_and_compose_into_a_pipeline(tmp_path):
    loaded = {
        stem: load_component_from_file(str(ROOT / f"components/{folder}/{stem}.yaml"))
        for folder, stems in COMPONENTS.items()
        for stem in stems
    }

    @dsl.pipeline(name="from-uploaded-components")
    def p(source_uri: str, model_def: str, publish_uri: str):
        d = loaded["data_prep"](source_uri=source_uri, label="label")
        t = loaded["elastic_train"](
            train_data=d.outputs["train_data"], eval_data=d.outputs["eval_data"], model_def=model_def, max_workers=4
        )
        e = loaded["evaluate"](
            model=t.outputs["model"], eval_data=d.outputs["eval_data"], model_def=model_def, threshold=0.8
        )
        with dsl.If(e.outputs["passed"] == True):  # noqa: E712
            loaded["publish_model"](model=t.outputs["model"], publish_uri=publish_uri)
        # the URI variants compose too (strings in, the same outputs)
        tu = loaded["elastic_train_uri"](train_uri="gs://b/train/", eval_uri="gs://b/eval/", model_def=model_def)
        loaded["evaluate_uri"](model_uri="gs://b/model/", eval_uri="gs://b/eval/", model_def=model_def)
        assert set(tu.outputs) == set(t.outputs)

    out = tmp_path / "p.yaml"
    compiler.Compiler().compile(p, str(out))
    spec = yaml.safe_load(out.read_text())
    assert {
        "exec-data-prep-op",
        "exec-elastic-train-op",
        "exec-evaluate-op",
        "exec-publish-model-op",
        "exec-elastic-train-uri-op",
        "exec-evaluate-uri-op",
    } <= set(spec["deploymentSpec"]["executors"])


def test_train_and_evaluate_outputs():
    train = yaml.safe_load((ROOT / "components/elastic_train/elastic_train.yaml").read_text())
    outs = train["components"]["comp-elastic-train-op"]["outputDefinitions"]["artifacts"]
    assert {k: v["artifactType"]["schemaTitle"] for k, v in outs.items()} == {
        "model": "system.Model",
        "metrics": "system.Metrics",
        "report": "system.HTML",
        "summary": "system.Artifact",
    }
    ev = yaml.safe_load((ROOT / "components/evaluate/evaluate.yaml").read_text())
    out = ev["components"]["comp-evaluate-op"]["outputDefinitions"]
    assert {k: v["artifactType"]["schemaTitle"] for k, v in out["artifacts"].items()} == {
        "metrics": "system.Metrics",
        "classification_metrics": "system.ClassificationMetrics",
    }
    assert {k: v["parameterType"] for k, v in out["parameters"].items()} == {
        "score": "NUMBER_DOUBLE",
        "passed": "BOOLEAN",
    }


def test_uri_variants_match_the_artifact_variants():
    """Same parameters and outputs; only the data inputs differ (URIs instead of artifacts), and the UI's variant
    takes no TaskConfig (the UI cannot set one)."""
    for folder, a, b, swapped in (
        ("elastic_train", "elastic_train", "elastic_train_uri", {"train_uri", "eval_uri"}),
        ("evaluate", "evaluate", "evaluate_uri", {"model_uri", "eval_uri"}),
    ):
        sa, sb = (yaml.safe_load((ROOT / f"components/{folder}/{s}.yaml").read_text())["root"] for s in (a, b))
        pa = {k: v for k, v in sa["inputDefinitions"]["parameters"].items() if v["parameterType"] != "TASK_CONFIG"}
        pb = sb["inputDefinitions"]["parameters"]
        assert set(pb) - set(pa) == swapped and set(pa) <= set(pb)
        assert {k: v.get("defaultValue") for k, v in pa.items()} == {k: pb[k].get("defaultValue") for k in pa}
        assert sa["outputDefinitions"] == sb["outputDefinitions"]


def test_ui_uploadable_files_take_only_strings_and_numbers():
    """The KFP UI starts an uploaded component as a one-step pipeline: every input must be a parameter."""
    for rel in (
        "components/data_prep/data_prep.yaml",
        "components/elastic_train/elastic_train_uri.yaml",
        "components/evaluate/evaluate_uri.yaml",
        "pipelines/train_eval/train_eval.yaml",
    ):
        spec = next(yaml.safe_load_all((ROOT / rel).read_text()))
        inputs = spec["root"].get("inputDefinitions", {})
        assert "artifacts" not in inputs, rel
        assert {p["parameterType"] for p in inputs["parameters"].values()} <= {
            "STRING",
            "NUMBER_INTEGER",
            "NUMBER_DOUBLE",
            "BOOLEAN",
        }, rel


def test_pipeline_gates_publish_on_evaluate_passed():
    spec, _ = kfp_pipeline()
    root = spec["root"]["dag"]["tasks"]
    (gate,) = [t for t in root.values() if "triggerPolicy" in t]
    assert gate["taskInfo"]["name"] == "gate-passed"
    assert (
        gate["triggerPolicy"]["condition"] == "inputs.parameter_values['pipelinechannel--evaluate-op-passed'] == true"
    )
    assert gate["inputs"]["parameters"]["pipelinechannel--evaluate-op-passed"]["taskOutputParameter"] == {
        "producerTask": "evaluate-op",
        "outputParameterKey": "passed",
    }
    branch = spec["components"][gate["componentRef"]["name"]]["dag"]["tasks"]
    assert set(branch) == {"publish-model-op"}
    assert "publish-model-op" not in root
    assert root["data-prep-op"]["cachingOptions"] == {}  # the source URI's content changes: never cached


def test_the_pipelines_training_pod_carries_the_masters_scrape_labels_and_annotations():
    """A Prometheus that scrapes annotated pods, or a PodMonitor selecting the labels, finds the master's /metrics
    on the KFP training step's pod as on the Argo template's; no other step's pod is scraped."""
    spec, platform = kfp_pipeline()
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    train = spec["components"]["comp-elastic-train-op"]["executorLabel"]
    assert executors == {
        train: {"podMetadata": {"labels": health.SCRAPE_LABELS, "annotations": health.SCRAPE_ANNOTATIONS}}
    }
    assert health.SCRAPE_ANNOTATIONS["prometheus.io/port"] == str(health.POD_PORT)


def training_task(model_def):
    """The training component as a task of a pipeline being built, on imported data."""
    from elastic_step.components import elastic_train_op

    return elastic_train_op(
        train_data=dsl.importer(artifact_uri="gs://b/t/", artifact_class=dsl.Dataset).output,
        eval_data=dsl.importer(artifact_uri="gs://b/e/", artifact_class=dsl.Dataset).output,
        model_def=model_def,
    )


def test_the_scrape_metadata_adds_to_the_pod_metadata_a_pipeline_author_gives_the_training_task(tmp_path):
    """kfp-kubernetes' add_pod_label writes the task's platform config where `scraped` does: neither loses the
    other's."""
    from elastic_step.pipelines.train_eval import scraped

    @dsl.pipeline(name="labelled")
    def p(model_def: str):
        t = training_task(model_def)
        # as kubernetes.add_pod_label(t, "team", "a") and kubernetes.add_node_selector(t, "pool", "spot") write them
        t.platform_config["kubernetes"] = {
            "podMetadata": {"labels": {"team": "a"}},
            "nodeSelector": {"labels": {"pool": "spot"}},
        }
        scraped(t)

    compiler.Compiler().compile(p, str(tmp_path / "p.yaml"))
    _, platform = yaml.safe_load_all((tmp_path / "p.yaml").read_text())
    (executor,) = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values()
    assert executor["podMetadata"] == {
        "labels": {"team": "a", **health.SCRAPE_LABELS},
        "annotations": health.SCRAPE_ANNOTATIONS,
    }
    assert executor["nodeSelector"] == {"labels": {"pool": "spot"}}


# ---------------------------------------------------------------- a retried training step resumes its job
TRAIN_STEMS = COMPONENTS["elastic_train"]
JOB_ID_INPUTS = {"job_id", "pipeline_run_id", "pipeline_task_name"}


def test_the_pipelines_training_task_is_retried_with_a_job_id_from_the_placeholders():
    spec, _ = kfp_pipeline()
    train = spec["root"]["dag"]["tasks"]["elastic-train-op"]
    assert train["retryPolicy"] == {
        "maxRetryCount": 2,
        "backoffDuration": "15s",
        "backoffFactor": 2.0,
        "backoffMaxDuration": "604800s",
    }  # outlasts the training (1 h by default)
    # Each placeholder is an argument's whole value: KFP substitutes nothing else.
    inputs = train["inputs"]["parameters"]
    assert inputs["pipeline_run_id"] == {"runtimeValue": {"constant": dsl.PIPELINE_JOB_ID_PLACEHOLDER}}
    assert inputs["pipeline_task_name"] == {"runtimeValue": {"constant": dsl.PIPELINE_TASK_NAME_PLACEHOLDER}}
    assert "job_id" not in inputs  # derived, unless a pipeline author passes one
    # Not the task id or pod: they are not what a retry keeps.
    assert "pipeline_task_uuid" not in str(train) and "KFP_POD" not in str(train)
    for name, task in spec["root"]["dag"]["tasks"].items():
        if name != "elastic-train-op":
            assert "retryPolicy" not in task, name


@pytest.mark.parametrize("stem", TRAIN_STEMS)
def test_training_components_derive_the_job_id_unless_given_one(stem):
    spec = yaml.safe_load((ROOT / f"components/elastic_train/{stem}.yaml").read_text())
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert {n: (params[n]["parameterType"], params[n]["defaultValue"]) for n in JOB_ID_INPUTS} == dict.fromkeys(
        JOB_ID_INPUTS, ("STRING", "")
    )
    code = "".join(next(iter(spec["deploymentSpec"]["executors"].values()))["container"]["command"])
    assert "arguments = dict(locals())" in code and "run_training(" in code  # its own arguments, all of them


def test_a_training_component_runs_its_job_with_its_own_settings_and_a_derived_id(monkeypatch, tmp_path):
    """run_training, the training components' body: the spec's settings as given, the model definition, and a
    job id derived from KFP's run id and task name (the same in every retry of the step)."""
    from types import SimpleNamespace

    from elastic_step import steps
    from elastic_step.components.outputs import run_training

    ran = {}

    def train_step(train, eval, model_def, model_dir, report, summary, **settings):
        ran.update(train=train, eval=eval, model_def=model_def, model_dir=model_dir, **settings)
        return {"status": "succeeded", "job_id": settings["job_id"], "eval": {"accuracy": 0.5}}

    monkeypatch.setattr(steps, "train_step", train_step)

    def artifact(name):  # what run_training uses of a KFP artifact (and of Metrics)
        return SimpleNamespace(path=str(tmp_path / name), uri=f"gs://b/{name}", metadata={}, log_metric=print)

    arguments = {
        "model": artifact("model"),
        "metrics": artifact("metrics"),
        "report": artifact("report"),
        "summary": artifact("summary"),
        "model_def": "m.py",
        "epochs": 3,
        "worker_cpu": "",
        "checkpoint_uri": "gs://b/ckpt",
        "job_id": "",
        "pipeline_run_id": "run-1",
        "pipeline_task_name": "elastic-train-op",
    }
    run_training("train/", "eval/", arguments)
    assert ran["job_id"] == steps.step_job_id("", "run-1", "elastic-train-op") and ran["job_id"].startswith("elastic")
    assert (ran["train"], ran["eval"], ran["model_def"], ran["epochs"]) == ("train/", "eval/", "m.py", 3)
    assert (ran["worker_cpu"], ran["checkpoint_uri"]) == ("", "gs://b/ckpt")
    assert "pipeline_run_id" not in ran and "model" not in ran
    arguments["job_id"] = "mine"
    run_training("train/", "eval/", arguments)
    assert ran["job_id"] == "mine"


def test_the_kfp_training_components_and_the_argo_step_take_the_same_settings():
    """Both run one training job with the same knobs: the components' parameters are the Argo step's
    CLI flags (with dashes), the data and the job id's sources aside; and both pass a job id."""
    from elastic_step.pipelines.argo import TRAIN_PARAMS, workflow_template

    for stem in TRAIN_STEMS:
        params = yaml.safe_load((ROOT / f"components/elastic_train/{stem}.yaml").read_text())["root"][
            "inputDefinitions"
        ]["parameters"]
        settings = (
            {n.replace("_", "-") for n, p in params.items() if p["parameterType"] != "TASK_CONFIG"}  # KFP fills it
            - {"train-uri", "eval-uri"}
            - {n.replace("_", "-") for n in JOB_ID_INPUTS}
        )
        assert settings == set(TRAIN_PARAMS), stem
    train = next(t for t in workflow_template().templates if t.name == "elastic-train")
    assert "--job-id" in train.args


def test_step_job_id():
    from elastic_step.backends.kubernetes import _JOB_ID
    from elastic_step.steps import step_job_id

    run_a, run_b = "2c1b7a4e-5d6f-4a3b-9c8d-0e1f2a3b4c5d", "9e8d7c6b-5a4f-4e3d-8c2b-1a0f9e8d7c6b"
    a = step_job_id("", run_a, "elastic-train-op", anchor="gs://b/r/a/elastic-train-op/model")
    assert a == step_job_id("", run_a, "elastic-train-op", anchor="another attempt's URI")  # every retry
    assert a != step_job_id("", run_b, "elastic-train-op") != step_job_id("", run_a, "elastic-train-op-2")
    assert a.startswith("elastic-train-op-")
    assert step_job_id("mine", run_a, "elastic-train-op") == "mine"  # an explicit id wins as it is
    # KFP left a placeholder unresolved (it substitutes only whole arguments): the artifact URI decides
    unresolved = step_job_id(
        "",
        dsl.PIPELINE_JOB_ID_PLACEHOLDER,
        dsl.PIPELINE_TASK_NAME_PLACEHOLDER,
        anchor="minio://mlpipeline/v2/artifacts/p/run-1/elastic-train-op/model",
    )
    assert unresolved.startswith("es-") and "{" not in unresolved
    assert unresolved == step_job_id(
        "", "", "", anchor="minio://mlpipeline/v2/artifacts/p/run-1/elastic-train-op/model"
    )
    assert step_job_id("", "", "", anchor="") is None  # nothing stable: a random id, as before
    for job_id in (a, unresolved, step_job_id("", run_a, "Train: the BIG model " * 5)):
        assert len(job_id) <= 50 and _JOB_ID.fullmatch(job_id), job_id  # names pods <job>-<role>-<index>


def test_kfp_local_resolves_the_placeholders_the_job_id_comes_from(tmp_path):
    """kfp.local (SubprocessRunner: `elastic-step pipeline run`, `make demo`) resolves both placeholders,
    the run id to a random number, and runs a task with a retry policy (it does not retry)."""
    script = tmp_path / "probe.py"
    script.write_text(f"""
import sys
from kfp import dsl, local
from kfp.dsl import Model, Output

@dsl.component
def probe(model: Output[Model], pipeline_run_id: str = "", pipeline_task_name: str = "") -> str:
    import json
    from elastic_step.steps import step_job_id
    return json.dumps([pipeline_run_id, pipeline_task_name, step_job_id("", pipeline_run_id, pipeline_task_name,
                                                                        anchor=model.uri)])

@dsl.pipeline
def p() -> str:
    t = probe(pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, pipeline_task_name=dsl.PIPELINE_TASK_NAME_PLACEHOLDER)
    t.set_retry(num_retries=2, backoff_max_duration="168h")
    return t.outputs["Output"]

local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root={str(tmp_path / "root")!r})
sys.stderr.write("RESULT " + p().output + "\\n")
""")
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id, task_name, job_id = json.loads(proc.stderr.split("RESULT ", 1)[1].splitlines()[0])
    assert run_id.isdigit() and task_name == "probe"
    assert job_id.startswith("probe-") and len(job_id) <= 50


SAMPLE = {"Integer": "3", "Float": "0.5", "String": "text"}


def v1_argv(command: list, present: set, values: dict) -> list[str]:
    """A v1 command line with its placeholders filled the way a v1 runner fills them."""
    argv = []
    for item in command:
        if isinstance(item, str):
            argv.append(item)
        elif "inputValue" in item:
            argv.append(values[item["inputValue"]])
        elif "inputPath" in item or "outputPath" in item:
            argv.append(f"/tmp/{item.get('inputPath') or item.get('outputPath')}")
        elif "concat" in item:
            argv.append("".join(v1_argv(item["concat"], present, values)))
        elif "if" in item:
            if item["if"]["cond"]["isPresent"] in present:
                argv.extend(v1_argv(item["if"]["then"], present, values))
        else:
            raise AssertionError(f"unknown placeholder {item}")
    return argv


@pytest.mark.parametrize("rel", V1_FILES)
def test_v1_components_for_elyra_run_commands_the_cli_accepts(rel):
    spec = yaml.safe_load((ROOT / rel).read_text())
    component = load_component_from_file(str(ROOT / rel))  # what Elyra and the KFP SDK read
    assert component.component_spec.implementation.container.image == DEFAULT_IMAGE
    command = spec["implementation"]["container"]["command"]
    names = {i["name"] for i in spec.get("inputs", [])} | {o["name"] for o in spec.get("outputs", [])}
    used = set(re.findall(r"'(?:inputValue|inputPath|outputPath|isPresent)': '(\w+)'", str(command)))
    assert used == names, f"{rel}: declared but unused {names - used}, used but undeclared {used - names}"
    optional = {i["name"] for i in spec.get("inputs", []) if i.get("optional")}
    values = {i["name"]: i.get("default", SAMPLE.get(i["type"], "x")) for i in spec.get("inputs", [])}
    for present in (set(), optional):
        argv = v1_argv(command, present, values)
        assert argv[0] == "elastic-step"
        build_parser().parse_args(argv[1:])  # SystemExit (test error) if the CLI does not take it


@pytest.mark.parametrize("folder", list(COMPONENTS))
def test_each_component_readme_documents_use_upload_and_elyra(folder):
    text = (ROOT / "components" / folder / "README.md").read_text()
    assert "elastic_train_op(" in text, "the DSL usage example"
    assert "```python" in text
    assert "KFP UI" in text and "Upload" in text
    assert "Elyra" in text and f"components/{folder}/component.yaml" in text
    for stem in COMPONENTS[folder]:
        assert f"{stem}.yaml" in text
        spec = yaml.safe_load((ROOT / f"components/{folder}/{stem}.yaml").read_text())
        comp = next(iter(spec["components"].values()))
        io = [
            *comp.get("inputDefinitions", {}).get("parameters", {}),
            *comp.get("inputDefinitions", {}).get("artifacts", {}),
            *comp.get("outputDefinitions", {}).get("parameters", {}),
            *comp.get("outputDefinitions", {}).get("artifacts", {}),
        ]
        missing = [n for n in io if f"`{n}`" not in text and n != "Output"]
        assert not missing, f"{folder}/README.md does not document {missing} of {stem}.yaml"


def test_component_bodies_import_under_the_kfp_runtime():
    """In a step, KFP runs the body with its runtime-only kfp.dsl (_KFP_RUNTIME=true: no dsl.component);
    what the bodies import must not need the component definitions."""

    bodies = "\n".join(
        sorted(
            {
                line.strip()
                for line in (ROOT / "elastic_step/components/ops.py").read_text().splitlines()
                if line.startswith("    from elastic_step")
            }
        )
    )
    assert "elastic_step.components.outputs" in bodies and "elastic_step.steps" in bodies
    proc = subprocess.run(
        [sys.executable, "-c", bodies + "\nimport sys\nassert 'elastic_step.components.ops' not in sys.modules"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "_KFP_RUNTIME": "true"},
    )
    assert proc.returncode == 0, proc.stderr


def test_v1_components_compose_into_a_pipeline(tmp_path):
    """What Elyra does with them on KFP: prepared folder → train → evaluate, and publish."""
    prep, train, evaluate, publish = (load_component_from_file(str(ROOT / rel)) for rel in V1_FILES)

    @dsl.pipeline(name="elyra-like")
    def p(source_uri: str, model_def: str):
        d = prep(source_uri=source_uri)
        t = train(prepared=d.outputs["prepared"], model_def=model_def, worker_cpu="2")
        evaluate(model=t.outputs["model"], prepared=d.outputs["prepared"], model_def=model_def)
        publish(model=t.outputs["model"], publish_uri="gs://bucket/models/")

    out = tmp_path / "elyra.yaml"
    compiler.Compiler().compile(p, str(out))
    executors = yaml.safe_load(out.read_text())["deploymentSpec"]["executors"]
    commands = {name: c["container"]["command"][:2] for name, c in executors.items()}
    assert sorted(commands.values()) == [
        ["elastic-step", "data"],
        ["elastic-step", "evaluate"],
        ["elastic-step", "publish"],
        ["elastic-step", "train"],
    ]


def test_the_image_is_overridable_when_compiling(tmp_path):
    image = "registry.example.com/ml/elastic-step:custom"
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_step.cli", "compile", "--root", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "ELASTIC_STEP_IMAGE": image},
    )
    assert proc.returncode == 0, proc.stderr
    for rel in IR_FILES + V1_FILES + ["pipelines/train_eval/train_eval.yaml"]:
        images = set(re.findall(r"(?m)^\s*image: (\S+)", (tmp_path / rel).read_text()))
        assert images == {image}, (rel, images)


def test_the_training_component_takes_the_task_config_kfp_passes_through():
    """What a pipeline sets on the training task reaches the component (KFP's driver injects it as the TASK_CONFIG
    input): resources and placement for the workers only, env and volumes on the step's own pod too."""
    train = yaml.safe_load((ROOT / "components/elastic_train/elastic_train.yaml").read_text())
    comp = train["components"]["comp-elastic-train-op"]
    assert comp["inputDefinitions"]["parameters"]["task_config"] == {"isOptional": True, "parameterType": "TASK_CONFIG"}
    assert comp["taskConfigPassthroughs"] == [
        {"field": "RESOURCES"},
        {"field": "KUBERNETES_TOLERATIONS"},
        {"field": "KUBERNETES_NODE_SELECTOR"},
        {"field": "KUBERNETES_AFFINITY"},
        {"field": "ENV", "applyToTask": True},
        {"field": "KUBERNETES_VOLUMES", "applyToTask": True},
    ]
    pipeline, _ = kfp_pipeline()
    assert pipeline["components"]["comp-elastic-train-op"]["taskConfigPassthroughs"] == comp["taskConfigPassthroughs"]


def test_a_task_that_sets_resources_on_the_training_step_compiles(tmp_path):
    """KFP refuses a task setting what its component does not pass through: the training step's may set them."""

    @dsl.pipeline(name="gpus")
    def p(model_def: str):
        t = training_task(model_def)
        t.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(1).set_cpu_limit("4").set_env_variable("A", "b")

    compiler.Compiler().compile(p, str(tmp_path / "p.yaml"))
