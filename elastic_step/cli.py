"""The `elastic-step` command line.

Progress and logs go to stderr; stdout carries one machine-readable JSON result per command,
so `elastic-step train ... | jq .eval` works in scripts and pipeline steps. `pipeline run`, which
people run by hand, prints a short summary for a person instead; its JSON result is behind `--json`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from elastic_step import spec
from elastic_step.errors import ElasticStepError, write_termination_message
from elastic_step.util import json_text, logs

CHAOS_METAVAR = "ACTION:INSTANCE@RECORDS"


def _add_train_args(p: argparse.ArgumentParser) -> None:
    spec.add_arguments(p, spec.TRAIN)
    p.add_argument(
        "--prepared",
        metavar="DIR",
        help="the folder `data prep` wrote: the same as --train-data DIR/train --eval-data DIR/eval",
    )
    p.add_argument(
        "--chaos",
        action="append",
        default=[],
        metavar=CHAOS_METAVAR,
        help="testing: kill:worker-0@400 SIGKILLs worker-0 after 400 committed records; term: sends SIGTERM",
    )


def _train_epilog() -> str:
    from elastic_step.backends import kubernetes as k8s

    return f"""\
--backend kubernetes
  The master (this process, normally in the pipeline step's pod) creates each worker and PS as a
  pod <job-id>-<role>-<index> in its namespace, relaunches lost ones (a preempted worker's pod
  stays Pending until the scheduler finds room), and deletes them all at the end or on SIGTERM.
  Credentials: KUBECONFIG when set, else the pod's service account, else ~/.kube/config.
  Pod settings by role: --worker-*/--ps-* cpu, memory, accelerators, tolerations, node selector,
  affinity; --job-service-account, --env, --env-from-secrets, --volumes; --spot-nodes (default auto:
  workers tolerate and prefer spot nodes, the PS avoid them); --queue (a Kueue LocalQueue).
  Environment:
    {k8s.NAMESPACE_ENV}   namespace (default: the service account's, or the kubeconfig context's)
    KUBECONFIG               credentials from outside the cluster
    {k8s.POD_SPEC_ENV}    JSON merged into every pod's spec, under the pod settings (imagePullSecrets, ...)
    {k8s.POD_LABELS_ENV}  JSON labels added to the pods, by role: {{"worker": {{"k": "v"}}, "ps": ..., "*": ...}}
    KFP_POD_NAME/KFP_POD_UID or POD_NAME/POD_UID (downward API)
                             the pod that owns the job's pods: deleting it deletes them
    POD_IP (downward API)    the address the pods reach the master at
  Permissions: the namespaced Role in {k8s.ROLE_FILE}
  (also components/elastic_train/rbac.yaml); a missing verb stops the master at once, naming it.
  Priority: workers {k8s.DEFAULT_PRIORITY["worker"]}, PS {k8s.DEFAULT_PRIORITY["ps"]} when they exist;
  sample PriorityClasses in {k8s.PRIORITY_FILE}.
"""


def _prepared(args, *names: str) -> None:
    """--prepared DIR stands for DIR/train and DIR/eval where --train-data / --eval-data are not given:
    a pipeline editor (Elyra) passes one folder from the data prep node as it is."""
    from elastic_step.errors import ConfigError

    for name in names:
        if getattr(args, f"{name}_data") is None and args.prepared:
            setattr(args, f"{name}_data", args.prepared.rstrip("/") + "/" + name)
    if "train" in names and args.train_data is None:
        raise ConfigError(
            "No training data: pass --train-data (a train manifest or its folder) or --prepared "
            "(the folder `elastic-step data prep` wrote)."
        )
    if "train" not in names and args.eval_data is None:
        raise ConfigError(
            "No eval data: pass --eval-data (an eval manifest or its folder) or --prepared "
            "(the folder `elastic-step data prep` wrote)."
        )


def _train(args) -> dict:
    from elastic_step.master.api import TrainConfig
    from elastic_step.master.job import train

    _prepared(args, "train", "eval")
    cfg = TrainConfig(**spec.values(args, spec.TRAIN), chaos=tuple(args.chaos))
    s = train(cfg)
    return {
        "status": s["status"],
        "job_id": s["job_id"],
        "eval": s["eval"],
        "outputs": s.get("outputs", {}),
        "summary": f"{args.output.rstrip('/')}/summary.json",
        "ledger": {
            "epochs": len(s["ledger"]["epochs"]),
            "records_committed": s["ledger"]["records_committed"],
            "exact": all(e["lost"] == 0 and e["double_applied"] == 0 for e in s["ledger"]["epochs"]),
        },
        "workers": s["workers"],
        "throughput_records_per_s": s["throughput_records_per_s"],
        "goodput_ratio": s["goodput"]["ratio"],
    }


def _prep(args) -> dict:
    from elastic_step.data.prep import prepare

    settings = spec.values(args, spec.PREP)
    source, label, weights = settings.pop("source_uri"), settings.pop("label"), settings.pop("weight_column")
    # an empty label or weight column: none
    r = prepare(source, args.output, label=label or None, weight_column=weights or None, **settings)
    return {
        "train": r.train_uri,
        "eval": r.eval_uri,
        "train_rows": r.train.total_rows,
        "eval_rows": r.eval.total_rows,
        "skipped_rows": r.train.skipped_rows + r.eval.skipped_rows,
        "non_finite_rows": r.train.non_finite.get("rows", 0),  # dropped or zeroed (the same count in both)
    }


def _pipeline_run(args) -> dict:
    from elastic_step.faults.chaos import Chaos
    from elastic_step.pipelines.local_run import print_run, run_local

    # A bad spec is an error now, not in the training step's log.
    Chaos(args.chaos, 1, args.max_workers, args.num_ps if args.strategy == "ps" else 0)
    if args.chaos:
        logging.getLogger("elastic_step").warning(
            "chaos, on purpose: the training step will %s (--chaos), to show training going on through the loss",
            ", ".join(args.chaos),
        )
    params = spec.values(args, spec.RUN)
    result = run_local(
        params.pop("source_uri"), params.pop("model_def"), params.pop("output"), chaos=args.chaos, **params
    )
    if args.json:  # the person's summary (stdout) is not printed then: keep the essentials on stderr
        print_run(result)
    return result


def _pipeline_text(result: dict) -> str:
    from elastic_step.pipelines.local_run import summary_text

    return summary_text(result)


def _evaluate(args) -> dict:
    from elastic_step.steps import evaluate_step, write_json

    _prepared(args, "eval")
    r = evaluate_step(args.model, args.eval_data, **spec.values(args, spec.EVAL))
    if args.metrics_out:
        write_json(args.metrics_out, r)
    if args.passed_out:  # for Argo: a parameter read from a file gates the publish step
        with open(args.passed_out, "w") as f:
            f.write("true" if r["passed"] else "false")
    return r


def _publish(args) -> dict:
    from elastic_step.steps import publish_step

    return {"published_to": publish_step(args.model, args.to, passed=True)}


def _schedule(args) -> dict:
    from elastic_step.pipelines.schedule import create_schedule

    return create_schedule(
        args.host,
        args.cron,
        spec.values(args, spec.PIPELINE),
        experiment=args.experiment,
        name=args.name,
        namespace=args.namespace,
        service_account=args.service_account,
        pipeline_root=args.pipeline_root,
    )


def _compile(args) -> dict:
    from elastic_step.pipelines.compile import compile_all

    return {"written": compile_all(args.root)}


def _add_schedule_args(sc: argparse.ArgumentParser) -> None:
    sc.add_argument("--host", required=True, help="KFP API endpoint, e.g. https://kfp.example.com/pipeline")
    sc.add_argument("--cron", required=True, help='6 fields, seconds first: "0 0 2 * * *" is 02:00 daily')
    spec.add_arguments(sc, spec.PIPELINE)
    sc.add_argument("--experiment", default="elastic-step")
    sc.add_argument("--name", default="elastic-step-train-eval-nightly")
    sc.add_argument("--namespace")
    sc.add_argument(
        "--service-account",
        help="the runs' service account (it needs the Role in "
        "components/elastic_train/rbac.yaml for backend kubernetes)",
    )
    sc.add_argument("--pipeline-root", help="where the runs' artifacts go (default: the cluster's)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-step", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default="text",
        help="json: one JSON object a line (job, role, event kind), for log shippers",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="data preparation").add_subparsers(dest="data_command", required=True)
    prep = data.add_parser("prep", help="CSV/Parquet/JSON lines -> validated Parquet shards + manifests")
    spec.add_arguments(prep, spec.PREP)
    prep.add_argument("--output", required=True, help="the folder for train/ and eval/, each a manifest and its shards")
    prep.set_defaults(func=_prep)

    train = sub.add_parser(
        "train",
        help="elastic training: master + workers + parameter servers",
        epilog=_train_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_train_args(train)
    train.set_defaults(func=_train)

    ev = sub.add_parser("evaluate", help="evaluate a trained model and decide the gate")
    ev.add_argument("--model", required=True, help="model.keras or the folder holding it (any fsspec URI)")
    ev.add_argument("--eval-data", help="eval manifest.json (or its folder)")
    ev.add_argument("--prepared", metavar="DIR", help="the folder `data prep` wrote: the same as --eval-data DIR/eval")
    spec.add_arguments(ev, spec.EVAL)
    ev.add_argument("--metrics-out", help="also write the result as JSON here")
    ev.add_argument("--passed-out", help="also write true/false (the gate) to this file")
    ev.set_defaults(func=_evaluate)

    pub = sub.add_parser("publish", help="copy a trained model folder to a URI")
    pub.add_argument("--model", required=True, help="folder with model.keras and saved_model/")
    pub.add_argument("--to", required=True, help="destination folder URI (gs://, s3://, local)")
    pub.set_defaults(func=_publish)

    pipeline = sub.add_parser("pipeline", help="the train→evaluate pipeline").add_subparsers(
        dest="pipeline_command", required=True
    )
    run = pipeline.add_parser("run", help="run it on this machine through kfp.local")
    spec.add_arguments(run, spec.RUN)
    run.add_argument(
        "--chaos",
        action="append",
        default=[],
        metavar=CHAOS_METAVAR,
        help="testing and the demo: disturb the training step on purpose, e.g. kill:worker-0@300000 "
        "SIGKILLs worker-0 once 300000 records are committed (as `elastic-step train --chaos`; "
        "also read from ELASTIC_STEP_CHAOS)",
    )
    run.add_argument(
        "--json",
        action="store_true",
        help="print the whole result as JSON on stdout (artifacts, metrics, metadata) instead of "
        "the summary for a person",
    )
    run.set_defaults(func=_pipeline_run, text=_pipeline_text)

    schedule = sub.add_parser("schedule", help="recurring retraining on a KFP cluster").add_subparsers(
        dest="schedule_command", required=True
    )
    sc = schedule.add_parser("create", help="compile the pipeline and create a KFP recurring run")
    _add_schedule_args(sc)
    sc.set_defaults(func=_schedule)

    comp = sub.add_parser(
        "compile", help="regenerate the compiled component and pipeline YAMLs (KFP, v1, Argo) and docs/parameters.md"
    )
    comp.add_argument("--root", default=".", help="repository root (components/, pipelines/ and docs/ go there)")
    comp.set_defaults(func=_compile)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from elastic_step.util.process import quiet_tensorflow

    quiet_tensorflow()
    if getattr(args, "job_id", None) == "" and args.log_format == "json":
        from elastic_step.master.plan import new_job_id

        args.job_id = new_job_id()  # decided here rather than by the job: every line names it
    logs.configure(
        args.log_format,
        logging.DEBUG if args.verbose else logging.INFO,
        "%(asctime)s %(name)s %(levelname)s %(message)s",
        role="master" if args.command == "train" else args.command,
        job=getattr(args, "job_id", "") or "",
        datefmt="%H:%M:%S",
    )
    try:
        # Libraries print on stdout (kfp.local's logs, kfp.Client's links): send them to stderr,
        # so stdout carries only our JSON result.
        with contextlib.redirect_stdout(sys.stderr):
            result = args.func(args)
    except ElasticStepError as e:
        print(f"elastic-step: error: {e}", file=sys.stderr)
        write_termination_message(str(e))
        return e.exit_code
    except KeyboardInterrupt:
        print("elastic-step: interrupted", file=sys.stderr)
        return 130
    if getattr(args, "text", None) is not None and not args.json:
        sys.stdout.write(args.text(result))
        return 0
    json_text.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def run() -> None:
    """The `elastic-step` command: main(), then the process's exit without TensorFlow's C++ teardown (util/
    process.py), which can abort after the step's own clean exit."""
    from elastic_step.util.process import exit_before_native_teardown

    exit_before_native_teardown(main())


if __name__ == "__main__":
    run()
