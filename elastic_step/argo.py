"""Argo Workflows: the train→evaluate pipeline as a WorkflowTemplate and a nightly CronWorkflow,
built with Hera and rendered to YAML under pipelines/argo/ (`python -m elastic_step.argo`).

Each step is a container running the `elastic-step` CLI in the runtime image; the prepared data and
the model pass between steps as Argo artifacts; the publish step runs only when evaluation passed.
The CronWorkflow uses `schedules` (Argo v3.6+ and v4), not the removed `schedule`.
"""
from __future__ import annotations

import pathlib

from hera.workflows import DAG, Artifact, Container, CronWorkflow, Parameter, WorkflowTemplate
from hera.workflows import models as m

from elastic_step import __version__

IMAGE = f"ghcr.io/elastic-step/elastic-step:{__version__}"
TEMPLATE_NAME = "elastic-step-train-eval"
PARAMETERS = {"source-uri": None, "model-def": None, "label": "label", "epochs": "10", "min-workers": "1",
              "max-workers": "4", "num-ps": "1", "backend": "kubernetes", "threshold": "0.9",
              "metric": "accuracy", "publish-uri": ""}


def _p(name: str) -> str:
    return f"{{{{inputs.parameters.{name}}}}}"


def workflow_template() -> WorkflowTemplate:
    with WorkflowTemplate(
            name=TEMPLATE_NAME, entrypoint="train-eval",
            arguments=[Parameter(name=k, value=v) if v is not None else Parameter(name=k)
                       for k, v in PARAMETERS.items()],
            service_account_name="elastic-step") as wt:
        prep = Container(
            name="data-prep", image=IMAGE, command=["elastic-step"],
            args=["data", "prep", "--source", _p("source-uri"), "--label", _p("label"), "--output", "/work/prepared"],
            inputs=[Parameter(name="source-uri"), Parameter(name="label")],
            outputs=[Artifact(name="prepared", path="/work/prepared")])
        train = Container(
            name="elastic-train", image=IMAGE, command=["elastic-step"],
            args=["train", "--model-def", _p("model-def"), "--train-data", "/work/prepared/train",
                  "--eval-data", "/work/prepared/eval", "--output", "/work/model", "--epochs", _p("epochs"),
                  "--min-workers", _p("min-workers"), "--max-workers", _p("max-workers"), "--num-ps", _p("num-ps"),
                  "--backend", _p("backend"), "--job-id", "{{workflow.name}}", "--progress", "lines"],
            inputs=[Artifact(name="prepared", path="/work/prepared")]
            + [Parameter(name=n) for n in ("model-def", "epochs", "min-workers", "max-workers", "num-ps", "backend")],
            outputs=[Artifact(name="model", path="/work/model")],
            # the master's own pod: owner of the worker and PS pods it creates
            env=[m.EnvVar(name="POD_NAME", value_from=m.EnvVarSource(field_ref=m.ObjectFieldSelector(
                     field_path="metadata.name"))),
                 m.EnvVar(name="POD_UID", value_from=m.EnvVarSource(field_ref=m.ObjectFieldSelector(
                     field_path="metadata.uid"))),
                 m.EnvVar(name="ELASTIC_STEP_POD_IP", value_from=m.EnvVarSource(field_ref=m.ObjectFieldSelector(
                     field_path="status.podIP")))])
        evaluate = Container(
            name="evaluate", image=IMAGE, command=["elastic-step"],
            args=["evaluate", "--model", "/work/model", "--eval-data", "/work/prepared/eval", "--model-def",
                  _p("model-def"), "--threshold", _p("threshold"), "--metric", _p("metric"),
                  "--metrics-out", "/work/result.json", "--passed-out", "/work/passed"],
            inputs=[Artifact(name="model", path="/work/model"), Artifact(name="prepared", path="/work/prepared"),
                    Parameter(name="model-def"), Parameter(name="threshold"), Parameter(name="metric")],
            outputs=[Parameter(name="passed", value_from=m.ValueFrom(path="/work/passed")),
                     Artifact(name="result", path="/work/result.json")])
        publish = Container(
            name="publish", image=IMAGE, command=["elastic-step"],
            args=["publish", "--model", "/work/model", "--to", _p("publish-uri")],
            inputs=[Artifact(name="model", path="/work/model"), Parameter(name="publish-uri")])

        wf = "{{workflow.parameters.%s}}"
        with DAG(name="train-eval"):
            p = prep(arguments={"source-uri": wf % "source-uri", "label": wf % "label"})
            t = train(arguments=[p.get_artifact("prepared").with_name("prepared")]
                      + [Parameter(name=n, value=wf % n)
                         for n in ("model-def", "epochs", "min-workers", "max-workers", "num-ps", "backend")])
            e = evaluate(arguments=[t.get_artifact("model").with_name("model"),
                                    p.get_artifact("prepared").with_name("prepared")]
                         + [Parameter(name=n, value=wf % n) for n in ("model-def", "threshold", "metric")])
            pub = publish(arguments=[t.get_artifact("model").with_name("model"),
                                     Parameter(name="publish-uri", value=wf % "publish-uri")],
                          when=f"{{{{tasks.{e.name}.outputs.parameters.passed}}}} == true")
            p >> t >> e >> pub
    return wt


def cron_workflow(schedule: str = "0 2 * * *", timezone: str = "UTC") -> CronWorkflow:
    """Nightly retraining from the template; a run still going blocks the next (Forbid)."""
    return CronWorkflow(
        name=f"{TEMPLATE_NAME}-nightly", schedules=[schedule], timezone=timezone, concurrency_policy="Forbid",
        starting_deadline_seconds=3600, successful_jobs_history_limit=3, failed_jobs_history_limit=3,
        workflow_template_ref=m.WorkflowTemplateRef(name=TEMPLATE_NAME),
        arguments=[Parameter(name="source-uri", value="gs://my-bucket/data/latest/"),
                   Parameter(name="model-def", value="gs://my-bucket/models/model.py"),
                   Parameter(name="publish-uri", value="gs://my-bucket/models/published/")])


def render(root: str = ".") -> list[str]:
    out = pathlib.Path(root) / "pipelines" / "argo"
    out.mkdir(parents=True, exist_ok=True)
    files = {"train-eval-template.yaml": workflow_template(), "train-eval-cron.yaml": cron_workflow()}
    written = []
    for name, resource in files.items():
        (out / name).write_text("# Generated by `python -m elastic_step.argo` (Hera); do not edit.\n"
                                + resource.to_yaml())
        written.append(str(out / name))
    return written


if __name__ == "__main__":
    print("\n".join(render()))
