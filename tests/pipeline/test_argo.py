"""The Argo Workflows files: current, every key one that Argo's spec defines where it stands and every
value of its type, checked against Hera's models of that spec (the pydantic models Hera generates from
Argo's OpenAPI schema: pydantic ignores unknown keys, so a typo would pass validation alone and the
strict key check walks the models itself), and wired the way Argo resolves them: every
parameter and artifact a template uses is declared and passed, every argument parses with the real CLI.

And Argo's own lint, offline and strict (`argo lint --offline --strict`), built from the Go module proxy
by scripts/build-argo: the shipped files pass, and it refuses a typo, an unresolved parameter and a
dangling dependency. No test reads outside the repository."""

from __future__ import annotations

import copy
import json
import pathlib
import re
import shlex
import types
import typing

import pydantic
import pytest
import yaml
from hera.workflows import models

from elastic_step.backends.kubernetes import _JOB_ID
from elastic_step.backends.kubernetes.security import restricted_violations
from elastic_step.cli import build_parser
from elastic_step.errors import ConfigError, JobFailed, StepTerminated
from elastic_step.master import health
from elastic_step.pipelines.argo import IMAGE, PARAMETERS, SERVICE_ACCOUNT, render
from tests.infra.kube.harness.argo import lint
from tests.pipeline.test_components import kfp_pipeline

ROOT = pathlib.Path(__file__).resolve().parents[2]
KINDS = {
    kind: getattr(models, kind) for kind in ("Workflow", "WorkflowTemplate", "ClusterWorkflowTemplate", "CronWorkflow")
}
FILES = ["train-eval-template.yaml", "train-eval-cron.yaml"]


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "pipelines" / "argo" / name).read_text())


def _models_in(annotation) -> list:
    """The types a field may hold, Optional and Annotated taken off."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [t for a in typing.get_args(annotation) for t in _models_in(a) if t is not type(None)]
    if typing.get_origin(annotation) is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    return [annotation]


def unknown_keys(doc, annotation, path: str = "") -> list[str]:
    """Keys of `doc` that the spec does not define at their position."""
    out = []
    for tp in _models_in(annotation):
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is list and isinstance(doc, list):
            for i, value in enumerate(doc):
                out += unknown_keys(value, args[0], f"{path}[{i}]")
        elif origin is dict and isinstance(doc, dict):  # a map (labels, annotations, resource quantities)
            for key, value in doc.items():
                out += unknown_keys(value, args[1], f"{path}.{key}")
        elif isinstance(tp, type) and issubclass(tp, pydantic.RootModel):
            out += unknown_keys(doc, tp.model_fields["root"].annotation, path)
        elif isinstance(tp, type) and issubclass(tp, pydantic.BaseModel) and isinstance(doc, dict):
            fields = {f.alias or name: f for name, f in tp.model_fields.items()}
            for key, value in doc.items():
                if key in fields:
                    out += unknown_keys(value, fields[key].annotation, f"{path}.{key}")
                else:
                    out.append(f"{path}.{key}")
        else:
            continue
        break  # the first type the value has decides
    return out


def check(doc: dict) -> list[str]:
    """Type errors plus unknown keys, for a Workflow, WorkflowTemplate or CronWorkflow."""
    model = KINDS[doc["kind"]]
    try:
        model.model_validate(doc)
        errors = []
    except pydantic.ValidationError as e:
        errors = [f"{'/'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
    if doc.get("apiVersion") != "argoproj.io/v1alpha1":
        errors.append(f"apiVersion {doc.get('apiVersion')!r}")
    return errors + [f"unknown key {k}" for k in unknown_keys(doc, model)]


# ---------------------------------------------------------------- current and valid
def test_rendered_files_are_current(tmp_path):
    for path in render(str(tmp_path)):
        name = pathlib.Path(path).name
        assert (ROOT / "pipelines" / "argo" / name).read_text() == pathlib.Path(path).read_text(), (
            f"pipelines/argo/{name} is stale: run `elastic-step compile` and commit"
        )


@pytest.mark.parametrize("name", FILES)
def test_valid_against_argos_spec_with_strict_keys(name):
    assert check(load(name)) == []


def test_a_workflow_submitted_from_the_template_is_valid():
    """What `argo submit --from workflowtemplate/...` creates: a Workflow referencing the template."""
    doc = {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"generateName": "elastic-step-train-eval-"},
        "spec": {
            "workflowTemplateRef": {"name": load(FILES[0])["metadata"]["name"]},
            "arguments": {
                "parameters": [
                    {"name": "source-uri", "value": "gs://b/d.csv"},
                    {"name": "model-def", "value": "gs://b/model.py"},
                ]
            },
        },
    }
    assert check(doc) == []
    # and the template's own spec is a valid Workflow spec (a Workflow can inline it)
    inline = {**load(FILES[0]), "kind": "Workflow"}
    assert check(inline) == []


# ---------------------------------------------------------------- Argo's own lint
def test_argos_own_lint_passes_the_shipped_files():
    """`argo lint --offline --strict`, Argo's own code (tests/infra/kube/argo/lint, built by scripts/build-argo): the
    CronWorkflow's reference to the WorkflowTemplate is resolved between the two files."""
    ok, out = lint([ROOT / "pipelines" / "argo" / name for name in FILES])
    assert ok, out


def _lint_mutated(tmp_path, mutate) -> str:
    doc = copy.deepcopy(load(FILES[0]))
    mutate(doc)
    (tmp_path / FILES[0]).write_text(yaml.safe_dump(doc, sort_keys=False))
    (tmp_path / FILES[1]).write_text((ROOT / "pipelines" / "argo" / FILES[1]).read_text())
    ok, out = lint([tmp_path / FILES[0], tmp_path / FILES[1]])
    assert not ok, out
    return out


def _template(doc: dict, name: str) -> dict:
    return next(t for t in doc["spec"]["templates"] if t["name"] == name)


def _dag(doc: dict) -> list[dict]:
    return next(t for t in doc["spec"]["templates"] if "dag" in t)["dag"]["tasks"]


@pytest.mark.parametrize(
    "mutate, says",
    [
        (
            lambda d: _template(d, "elastic-train")["container"].__setitem__(
                "comand", _template(d, "elastic-train")["container"].pop("command")
            ),
            'unknown field "spec.templates[1].container.comand"',
        ),
        (
            lambda d: _template(d, "evaluate")["container"]["args"].append("{{inputs.parameters.nope}}"),
            "templates.evaluate: failed to resolve {{inputs.parameters.nope}}",
        ),
        (lambda d: _dag(d)[-1].__setitem__("depends", "no-such-task"), "invalid dependency no-such-task"),
    ],
)
def test_argos_lint_refuses_what_the_controller_would(tmp_path, mutate, says):
    """The lint is Argo's: it fails on a typo, an unresolved parameter and a dangling dependency."""
    assert says in _lint_mutated(tmp_path, mutate)


# ---------------------------------------------------------------- the strict check catches typos
@pytest.mark.parametrize(
    "mutate, expected",
    [
        (
            lambda d: d["spec"].__setitem__("concurrencyPolicyy", d["spec"].pop("concurrencyPolicy")),
            "unknown key .spec.concurrencyPolicyy",
        ),
        (lambda d: d["spec"].__setitem__("schedule", d["spec"].pop("schedules")[0]), "unknown key .spec.schedule"),
        (
            lambda d: d["spec"].__setitem__("startingDeadline", d["spec"].pop("startingDeadlineSeconds")),
            "unknown key .spec.startingDeadline",
        ),
        (
            lambda d: d["spec"]["workflowSpec"]["workflowTemplateRef"].__setitem__("nmae", "x"),
            "unknown key .spec.workflowSpec.workflowTemplateRef.nmae",
        ),
        (lambda d: d["metadata"].__setitem__("lables", {}), "unknown key .metadata.lables"),
    ],
)
def test_a_typo_in_a_key_is_caught(mutate, expected):
    doc = copy.deepcopy(load("train-eval-cron.yaml"))
    mutate(doc)
    assert expected in check(doc)


def test_a_typo_deep_in_a_template_is_caught():
    doc = copy.deepcopy(load("train-eval-template.yaml"))
    train = next(t for t in doc["spec"]["templates"] if t["name"] == "elastic-train")
    train["container"]["comand"] = train["container"].pop("command")
    train["container"]["env"][0]["valueFrom"]["fieldRefs"] = train["container"]["env"][0]["valueFrom"].pop("fieldRef")
    train["retryStrategy"]["retryPolicyy"] = "OnError"
    dag = next(t for t in doc["spec"]["templates"] if "dag" in t)
    dag["dag"]["tasks"][3]["wehn"] = dag["dag"]["tasks"][3].pop("when")
    assert sorted(check(doc)) == [
        "unknown key .spec.templates[1].container.comand",
        "unknown key .spec.templates[1].container.env[0].valueFrom.fieldRefs",
        "unknown key .spec.templates[1].retryStrategy.retryPolicyy",
        "unknown key .spec.templates[4].dag.tasks[3].wehn",
    ]


def test_wrong_value_types_are_caught():
    doc = copy.deepcopy(load("train-eval-cron.yaml"))
    doc["spec"]["schedules"] = "0 2 * * *"  # a string, not a list
    doc["spec"]["startingDeadlineSeconds"] = "soon"
    errors = check(doc)
    assert any(e.startswith("spec/schedules") for e in errors), errors
    assert any(e.startswith("spec/startingDeadlineSeconds") for e in errors), errors


# ---------------------------------------------------------------- the DAG, as Argo would resolve it
def templates() -> dict[str, dict]:
    return {t["name"]: t for t in load("train-eval-template.yaml")["spec"]["templates"]}


def dag_tasks() -> dict[str, dict]:
    return {t["name"]: t for t in templates()["train-eval"]["dag"]["tasks"]}


def test_the_dag_is_the_kfp_pipeline_and_publish_is_gated():
    doc = load("train-eval-template.yaml")
    assert doc["metadata"]["name"] == "elastic-step-train-eval" and doc["spec"]["entrypoint"] == "train-eval"
    tasks = dag_tasks()
    assert list(tasks) == ["data-prep", "elastic-train", "evaluate", "publish"]
    assert [tasks[t].get("depends") for t in tasks] == [None, "data-prep", "elastic-train", "evaluate"]
    assert tasks["publish"]["when"] == "{{tasks.evaluate.outputs.parameters.passed}} == true"
    evaluate = templates()["evaluate"]
    assert evaluate["outputs"]["parameters"] == [{"name": "passed", "valueFrom": {"path": "/work/passed"}}]
    assert "--passed-out" in evaluate["container"]["args"]  # the CLI writes exactly true/false there


def test_every_parameter_and_artifact_is_declared_and_passed():
    doc = load("train-eval-template.yaml")
    declared = {p["name"] for p in doc["spec"]["arguments"]["parameters"]}
    tasks, tmpl = dag_tasks(), templates()
    for task in tasks.values():
        t = tmpl[task["template"]]
        inputs = t.get("inputs", {})
        args = task.get("arguments", {})
        # every input the template declares is passed by its task, and nothing else
        assert {p["name"] for p in inputs.get("parameters", [])} == {p["name"] for p in args.get("parameters", [])}
        assert {a["name"] for a in inputs.get("artifacts", [])} == {a["name"] for a in args.get("artifacts", [])}
        # the template uses only what it declares
        text = json.dumps(t)
        assert set(re.findall(r"inputs\.parameters\.([\w-]+)", text)) <= {p["name"] for p in inputs["parameters"]}
        # workflow parameters exist; artifacts come from an earlier task's declared outputs
        for p in args.get("parameters", []):
            for name in re.findall(r"workflow\.parameters\.([\w-]+)", p["value"]):
                assert name in declared, name
        for a in args.get("artifacts", []):
            src, art = re.fullmatch(r"\{\{tasks\.([\w-]+)\.outputs\.artifacts\.([\w-]+)\}\}", a["from"]).groups()
            assert art in {o["name"] for o in tmpl[tasks[src]["template"]]["outputs"]["artifacts"]}
            assert list(tasks).index(src) < list(tasks).index(task["name"])
    # artifact paths: each step reads its inputs where the previous one wrote them
    assert (
        tmpl["elastic-train"]["inputs"]["artifacts"][0]["path"] == tmpl["data-prep"]["outputs"]["artifacts"][0]["path"]
    )


def test_the_workflow_takes_every_kfp_pipeline_parameter():
    """Same knobs on both orchestrators: the KFP pipeline's parameters, with dashes."""
    spec, _ = kfp_pipeline()
    kfp = {n.replace("_", "-") for n in spec["root"]["inputDefinitions"]["parameters"]}
    argo = {p["name"] for p in load("train-eval-template.yaml")["spec"]["arguments"]["parameters"]}
    assert kfp <= argo, kfp - argo
    required = {n for n, (v, _) in PARAMETERS.items() if v is None}
    assert required == {"source-uri", "model-def"}


def test_the_workflow_and_the_kfp_pipeline_have_the_same_defaults():
    """One source of truth: a knob left alone does the same on either orchestrator."""
    spec, _ = kfp_pipeline()
    for name, p in spec["root"]["inputDefinitions"]["parameters"].items():
        if "defaultValue" not in p:
            continue
        kfp = p["defaultValue"]
        kfp = str(int(kfp)) if p["parameterType"] == "NUMBER_INTEGER" else str(kfp)
        assert PARAMETERS[name.replace("_", "-")][0] == kfp, name


WORKFLOW_UID = "8a0f6a52-3c1e-4d2b-9f7a-1b2c3d4e5f60"  # what Argo puts in {{workflow.uid}}


def _substitute(arg: str, values: dict[str, str]) -> str:
    arg = re.sub(r"\{\{inputs\.parameters\.([\w-]+)\}\}", lambda m: values[m.group(1)], arg)
    return arg.replace("{{workflow.uid}}", WORKFLOW_UID)


@pytest.mark.parametrize("template", ["data-prep", "elastic-train", "evaluate", "publish"])
def test_every_container_runs_a_real_cli_command(template):
    """The args parse with the real `elastic-step` parser, the workflow's defaults landing where meant."""
    t = templates()[template]
    c = t["container"]
    assert c["image"] == IMAGE and c["command"] == ["elastic-step"]
    values = {n: (v if v is not None else f"<{n}>") for n, (v, _) in PARAMETERS.items()}
    argv = [_substitute(a, values) for a in c["args"]]
    args = build_parser().parse_args(argv)
    if template == "elastic-train":
        assert (args.epochs, args.minibatch_size, args.records_per_task) == (1, 64, 0)
        assert (args.min_workers, args.max_workers, args.num_ps, args.backend) == (1, 2, 1, "auto")
        assert args.worker_image == "" and args.job_id == f"{WORKFLOW_UID}-elastic-train"
        assert args.output == "/work/model" and args.train_data == "/work/prepared/train"
        assert not args.chaos
    elif template == "data-prep":
        assert (args.source_uri, args.label, args.eval_fraction) == ("<source-uri>", "label", 0.2)
    elif template == "evaluate":
        assert (args.threshold, args.metric, args.passed_out) == (0.9, "accuracy", "/work/passed")
    else:
        assert args.to == "" and args.model == "/work/model"
    assert shlex.join(argv)  # printable as a shell command


def test_the_training_step_can_own_and_reach_its_pods():
    train = templates()["elastic-train"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in train["container"]["env"]}
    assert env == {
        "POD_NAME": "metadata.name",
        "POD_UID": "metadata.uid",
        "ELASTIC_STEP_NAMESPACE": "metadata.namespace",
        "ELASTIC_STEP_POD_IP": "status.podIP",
    }
    assert {a["name"] for a in train["outputs"]["artifacts"]} == {"model", "report", "summary"}


def test_a_retried_training_step_keeps_its_job_id():
    """Every attempt runs with the same --job-id, built from the workflow's uid and the step's name (not
    the pod's name, which each attempt changes), so the retried master resumes the job and adopts its pods."""
    tasks, train = dag_tasks(), templates()["elastic-train"]
    assert tasks["elastic-train"]["template"] == "elastic-train"
    args = train["container"]["args"]
    job_id = args[args.index("--job-id") + 1]
    assert job_id == "{{workflow.uid}}-elastic-train"
    assert not re.search(r"\{\{(pod|node|retries)", json.dumps(train["container"]))  # nothing per attempt
    resolved = _substitute(job_id, {})
    assert len(resolved) <= 50 and _JOB_ID.fullmatch(resolved), resolved  # it names the job's pods


def test_the_training_step_retries_what_took_it_away_not_a_failed_job():
    retry = templates()["elastic-train"]["retryStrategy"]
    assert retry["limit"] == "2" and retry["retryPolicy"] == "Always"  # IntOrString: the schema wants a string
    assert retry["backoff"] == {"duration": "15s", "factor": "2"}
    assert "maxDuration" not in retry["backoff"]  # counted from the first attempt: training outlasts any cap
    assert retry["expression"] == 'lastRetry.status == "Error" || asInt(lastRetry.exitCode) not in [1, 2]'
    # the exit codes it tells apart are the CLI's: a failed job, bad input, a terminated step
    assert (JobFailed.exit_code, ConfigError.exit_code, StepTerminated.exit_code) == (1, 2, 143)
    for name, t in templates().items():
        if name != "elastic-train":
            assert "retryStrategy" not in t, name


def test_the_training_step_is_probed_on_the_masters_health_endpoint():
    """The training container's liveness probe asks the port the step's master serves /healthz on (its args say
    which), and is patient enough that one late answer does not end a master; no other step is probed."""
    train = templates()["elastic-train"]["container"]
    probe = train["livenessProbe"]
    values = {n: (v if v is not None else f"<{n}>") for n, (v, _) in PARAMETERS.items()}
    args = build_parser().parse_args([_substitute(a, values) for a in train["args"]])
    assert probe["httpGet"] == {"path": health.PATH, "port": args.health_port} and args.health_port == health.POD_PORT
    assert probe["failureThreshold"] > 1 and probe["timeoutSeconds"] > 1 and probe["initialDelaySeconds"] > 0
    # ... and its /metrics scraped there: by the usual annotations, or by a PodMonitor naming the port
    assert train["ports"] == [{"name": "metrics", "containerPort": health.POD_PORT}]
    metadata = templates()["elastic-train"]["metadata"]
    assert metadata["labels"] == {"app.kubernetes.io/name": "elastic-step", "app.kubernetes.io/component": "master"}
    assert metadata["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(health.POD_PORT),
        "prometheus.io/path": health.METRICS_PATH,
    }
    for name, t in templates().items():
        if name != "elastic-train":
            assert "livenessProbe" not in t.get("container", {}), name


def test_pods_run_as_the_image_user_in_a_writable_work_dir_and_pass_restricted():
    spec = load("train-eval-template.yaml")["spec"]
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    for name, t in templates().items():
        if "container" in t:
            assert t["volumes"] == [{"name": "work", "emptyDir": {}}], name
            assert t["container"]["volumeMounts"] == [{"name": "work", "mountPath": "/work"}], name
            # the step's pod as Argo makes it, less Argo's own init and wait containers (compliant on their own)
            pod = {"securityContext": spec["securityContext"], "volumes": t["volumes"], "containers": [t["container"]]}
            assert restricted_violations(pod) == [], name


# ---------------------------------------------------------------- the cron, and the account it runs as
def test_the_cron_workflow():
    cron = load("train-eval-cron.yaml")["spec"]
    assert cron["schedules"] == ["0 2 * * *"] and "schedule" not in cron
    assert cron["concurrencyPolicy"] == "Forbid" and cron["startingDeadlineSeconds"] == 3600
    assert cron["workflowSpec"]["workflowTemplateRef"]["name"] == load(FILES[0])["metadata"]["name"]
    declared = {p["name"] for p in load(FILES[0])["spec"]["arguments"]["parameters"]}
    passed = {p["name"] for p in cron["workflowSpec"]["arguments"]["parameters"]}
    assert passed <= declared and {"source-uri", "model-def"} <= passed  # the required ones


def rbac(path: str) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all((ROOT / path).read_text())}


def test_the_service_account_exists_and_may_do_what_the_steps_do():
    assert load(FILES[0])["spec"]["serviceAccountName"] == SERVICE_ACCOUNT
    docs = {**rbac("components/elastic_train/rbac.yaml"), **rbac("pipelines/argo/rbac.yaml")}
    assert ("ServiceAccount", SERVICE_ACCOUNT) in docs
    granted = set()
    for (kind, _), binding in docs.items():
        if kind == "RoleBinding" and {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT} in binding["subjects"]:
            role = docs[("Role", binding["roleRef"]["name"])]
            granted |= {
                (g, r, v)
                for rule in role["rules"]
                for g in rule["apiGroups"]
                for r in rule["resources"]
                for v in rule["verbs"]
            }
    # Argo's executor reports outputs (v3.4+); the master runs worker and PS pods
    assert {("argoproj.io", "workflowtaskresults", v) for v in ("create", "patch")} <= granted
    assert {("", "pods", v) for v in ("create", "get", "list", "watch", "delete", "patch")} <= granted
    for doc in docs.values():
        assert doc["kind"] in ("ServiceAccount", "Role", "RoleBinding")  # nothing cluster-wide
        for rule in doc.get("rules", []):
            assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"]
