"""The `elastic-step` command line.

Progress and logs go to stderr; stdout carries one machine-readable JSON result per command,
so `elastic-step train ... | jq .eval` works in scripts and pipeline steps. `pipeline run`, which
people run by hand, prints a short summary for a person instead; its JSON result is behind `--json`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys

from elastic_step.errors import ElasticStepError, write_termination_message


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-def", required=True, help="module path (pkg.module) or path/URI of a .py file")
    p.add_argument("--train-data", help="train manifest.json (or its folder)")
    p.add_argument("--eval-data", help="eval manifest.json (or its folder)")
    p.add_argument("--prepared", metavar="DIR", help="the folder `data prep` wrote: the same as --train-data "
                   "DIR/train --eval-data DIR/eval")
    p.add_argument("--output", required=True, help="folder for model.keras, saved_model/, summary.json")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--minibatch-size", type=int, default=64)
    p.add_argument("--records-per-task", type=int, default=512)
    p.add_argument("--min-workers", type=int, default=1)
    p.add_argument("--max-workers", type=int, default=2)
    p.add_argument("--num-ps", type=int, default=1)
    p.add_argument("--strategy", default="ps", help="ps (async SGD with parameter servers) or allreduce "
                   "(sync SGD, elastic ring AllReduce between workers, no parameter servers)")
    p.add_argument("--global-batch", default="scaled", choices=["scaled", "fixed"],
                   help="allreduce: scaled (world x minibatch, learning rate scaled by world/max-workers) or "
                        "fixed (max-workers x minibatch kept by gradient accumulation)")
    p.add_argument("--pushes-in-flight", type=int, default=1,
                   help="ps: pushes each worker keeps in flight. 1 (default): a lone worker trains as "
                        "Keras fit does. 2: its step overlaps the PS's update (a lone digits-MLP worker ran "
                        "about 25%% faster), each gradient one update stale")
    p.add_argument("--minibatches-per-push", type=int, default=1, metavar="K",
                   help="ps: each push carries the mean gradient of K minibatches computed at the same "
                        "values, as Keras's gradient_accumulation_steps=K applies them: K times fewer updates "
                        "of the PS per epoch, and fewer round trips for a small model (see the README for "
                        "its speed and accuracy). 1 (default): one minibatch per push")
    p.add_argument("--backend", default="auto", metavar="{auto,local,kubernetes}",
                   help="auto (default): kubernetes when this runs in a pod whose service account holds the "
                        "Role's verbs, else local (the log says which and why); local: workers and PS are "
                        "subprocesses; kubernetes: they are pods in the step's namespace (see below)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--job-id", help="stable id of the job; names its pods, and a retried step that reuses it "
                   "takes over the job's pods instead of duplicating them")
    p.add_argument("--worker-cpu", help="kubernetes: cpu request = limit of each worker pod, e.g. 1 or 500m")
    p.add_argument("--worker-memory", help="kubernetes: memory request = limit of each worker pod, e.g. 2Gi")
    p.add_argument("--worker-priority-class", help="kubernetes: PriorityClass of worker pods (default elastic-low "
                   "when it exists)")
    p.add_argument("--ps-priority-class", help="kubernetes: PriorityClass of PS pods (default elastic-high when "
                   "it exists)")
    p.add_argument("--image", help="kubernetes: runtime image of worker and PS pods")
    p.add_argument("--progress", default="auto", choices=["auto", "bar", "lines", "off"])
    p.add_argument("--checkpoint-every", default="60s", metavar="INTERVAL",
                   help="cut a checkpoint of the PS shards and the ledger (under OUTPUT/checkpoints) every "
                        "INTERVAL: a time (60s, 5m) or a number of committed records (50000); 0 for none")
    p.add_argument("--checkpoint-dir", default="", metavar="URI",
                   help="where checkpoints go, as URI/<job-id>/ (a bucket, so a step retried in a new pod "
                        "finds them); default OUTPUT/checkpoints")
    p.add_argument("--resume", default="auto", choices=["auto", "never"],
                   help="auto: resume from this job's last checkpoint when there is one (a retried step); "
                        "never: start over")
    p.add_argument("--chaos", action="append", default=[], metavar="ACTION:INSTANCE@RECORDS",
                   help="testing: kill:worker-0@400 SIGKILLs worker-0 after 400 committed records; "
                        "term: sends SIGTERM")


def _train_epilog() -> str:
    from elastic_step.backends import kubernetes as k8s

    return f"""\
--backend kubernetes
  The master (this process, normally in the pipeline step's pod) creates each worker and PS as a
  pod <job-id>-<role>-<index> in its namespace, relaunches lost ones (a preempted worker's pod
  stays Pending until the scheduler finds room), and deletes them all at the end or on SIGTERM.
  Credentials: KUBECONFIG when set, else the pod's service account, else ~/.kube/config.
  Environment:
    {k8s.NAMESPACE_ENV}   namespace (default: the service account's, or the kubeconfig context's)
    KUBECONFIG               credentials from outside the cluster
    {k8s.POD_SPEC_ENV}    JSON merged into every pod's spec (nodeSelector, tolerations, ...)
    {k8s.POD_LABELS_ENV}  JSON labels added to the pods, by role: {{"worker": {{"k": "v"}}, "ps": ..., "*": ...}}
    KFP_POD_NAME/KFP_POD_UID or POD_NAME/POD_UID (downward API)
                             the pod that owns the job's pods: deleting it deletes them
    POD_IP (downward API)    the address the pods reach the master at
  Permissions: the namespaced Role in {k8s.ROLE_FILE}
  (also components/elastic_train/rbac.yaml); a missing verb stops the master at once, naming it.
  Priority: workers {k8s.DEFAULT_PRIORITY['worker']}, PS {k8s.DEFAULT_PRIORITY['ps']} when they exist;
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
        raise ConfigError("No training data: pass --train-data (a train manifest or its folder) or --prepared "
                          "(the folder `elastic-step data prep` wrote).")
    if "train" not in names and args.eval_data is None:
        raise ConfigError("No eval data: pass --eval-data (an eval manifest or its folder) or --prepared "
                          "(the folder `elastic-step data prep` wrote).")


def _train(args) -> dict:
    from elastic_step.master.api import TrainConfig
    from elastic_step.master.job import train

    _prepared(args, "train", "eval")
    cfg = TrainConfig(
        model_def=args.model_def, train_data=args.train_data, eval_data=args.eval_data, output=args.output,
        epochs=args.epochs, minibatch_size=args.minibatch_size, records_per_task=args.records_per_task,
        min_workers=args.min_workers, max_workers=args.max_workers, num_ps=args.num_ps,
        strategy=args.strategy, global_batch=args.global_batch, backend=args.backend,
        seed=args.seed, pushes_in_flight=args.pushes_in_flight,
        minibatches_per_push=args.minibatches_per_push, worker_cpu=args.worker_cpu,
        worker_memory=args.worker_memory, worker_priority_class=args.worker_priority_class,
        ps_priority_class=args.ps_priority_class, image=args.image, progress=args.progress,
        checkpoint_every=args.checkpoint_every, checkpoint_dir=args.checkpoint_dir, resume=args.resume,
        chaos=tuple(args.chaos))
    if args.job_id:
        cfg.job_id = args.job_id
    s = train(cfg)
    return {"status": s["status"], "job_id": s["job_id"], "eval": s["eval"], "outputs": s.get("outputs", {}),
            "summary": f"{args.output.rstrip('/')}/summary.json",
            "ledger": {"epochs": len(s["ledger"]["epochs"]), "records_committed": s["ledger"]["records_committed"],
                       "exact": all(e["lost"] == 0 and e["double_applied"] == 0 for e in s["ledger"]["epochs"])},
            "workers": s["workers"], "throughput_records_per_s": s["throughput_records_per_s"]}


def _prep(args) -> dict:
    from elastic_step.data.prep import prepare

    r = prepare(args.source, args.output, label=args.label, eval_fraction=args.eval_fraction,
                shard_rows=args.shard_rows, schema=args.schema, on_bad_rows=args.on_bad_rows, seed=args.seed)
    return {"train": r.train_uri, "eval": r.eval_uri, "train_rows": r.train.total_rows,
            "eval_rows": r.eval.total_rows, "skipped_rows": r.train.skipped_rows + r.eval.skipped_rows}


def _pipeline_run(args) -> dict:
    from elastic_step.faults.chaos import Chaos
    from elastic_step.pipelines.local_run import print_run, run_local

    # A bad spec is an error now, not in the training step's log.
    Chaos(args.chaos, 1, args.max_workers, args.num_ps if args.strategy == "ps" else 0)
    if args.chaos:
        logging.getLogger("elastic_step").warning(
            "chaos, on purpose: the training step will %s (--chaos), to show training going on through "
            "the loss", ", ".join(args.chaos))
    result = run_local(args.source, args.model_def, args.output, label=args.label, epochs=args.epochs,
                       minibatch_size=args.minibatch_size, records_per_task=args.records_per_task,
                       min_workers=args.min_workers, max_workers=args.max_workers, num_ps=args.num_ps,
                       strategy=args.strategy, global_batch=args.global_batch, threshold=args.threshold,
                       metric=args.metric, publish_uri=args.publish_uri,
                       eval_fraction=args.eval_fraction, seed=args.seed, chaos=args.chaos)
    if args.json:   # the person's summary (stdout) is not printed then: keep the essentials on stderr
        print_run(result)
    return result


def _pipeline_text(result: dict) -> str:
    from elastic_step.pipelines.local_run import summary_text

    return summary_text(result)


def _evaluate(args) -> dict:
    from elastic_step.steps import evaluate_step, write_json

    _prepared(args, "eval")
    r = evaluate_step(args.model, args.eval_data, args.model_def, metric=args.metric, threshold=args.threshold)
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

    params = {"source_uri": args.source, "model_def": args.model_def, "label": args.label, "epochs": args.epochs,
              "minibatch_size": args.minibatch_size, "min_workers": args.min_workers,
              "max_workers": args.max_workers, "num_ps": args.num_ps, "backend": args.backend,
              "worker_image": args.worker_image, "worker_cpu": args.worker_cpu,
              "worker_memory": args.worker_memory, "worker_priority_class": args.worker_priority_class,
              "ps_priority_class": args.ps_priority_class, "threshold": args.threshold,
              "metric": args.metric, "publish_uri": args.publish_uri}
    return create_schedule(args.host, args.cron, params, experiment=args.experiment, name=args.name,
                           namespace=args.namespace, service_account=args.service_account,
                           pipeline_root=args.pipeline_root)


def _compile(args) -> dict:
    from elastic_step.pipelines.compile import compile_all

    return {"written": compile_all(args.root)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-step", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="data preparation").add_subparsers(dest="data_command", required=True)
    prep = data.add_parser("prep", help="CSV/Parquet/JSON lines -> validated Parquet shards + manifests")
    prep.add_argument("--source", required=True, help="file, folder or glob; any fsspec URI")
    prep.add_argument("--output", required=True)
    prep.add_argument("--label")
    prep.add_argument("--eval-fraction", type=float, default=0.2)
    prep.add_argument("--shard-rows", type=int, default=50_000)
    prep.add_argument("--schema", help="JSON schema file: {\"fields\": [{\"name\", \"type\"}]}")
    prep.add_argument("--on-bad-rows", default="fail", choices=["fail", "skip"])
    prep.add_argument("--seed", type=int, default=0)
    prep.set_defaults(func=_prep)

    train = sub.add_parser("train", help="elastic training: master + workers + parameter servers",
                           epilog=_train_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_train_args(train)
    train.set_defaults(func=_train)

    ev = sub.add_parser("evaluate", help="evaluate a trained model and decide the gate")
    ev.add_argument("--model", required=True, help="model.keras or the folder holding it (any fsspec URI)")
    ev.add_argument("--eval-data", help="eval manifest.json (or its folder)")
    ev.add_argument("--prepared", metavar="DIR", help="the folder `data prep` wrote: the same as --eval-data DIR/eval")
    ev.add_argument("--model-def", required=True)
    ev.add_argument("--metric", default="accuracy")
    ev.add_argument("--threshold", type=float, default=0.9)
    ev.add_argument("--metrics-out", help="also write the result as JSON here")
    ev.add_argument("--passed-out", help="also write true/false (the gate) to this file")
    ev.set_defaults(func=_evaluate)

    pub = sub.add_parser("publish", help="copy a trained model folder to a URI")
    pub.add_argument("--model", required=True, help="folder with model.keras and saved_model/")
    pub.add_argument("--to", required=True, help="destination folder URI (gs://, s3://, local)")
    pub.set_defaults(func=_publish)

    pipeline = sub.add_parser("pipeline", help="the train→evaluate pipeline").add_subparsers(
        dest="pipeline_command", required=True)
    run = pipeline.add_parser("run", help="run it on this machine through kfp.local")
    run.add_argument("--source", required=True)
    run.add_argument("--model-def", required=True)
    run.add_argument("--output", required=True)
    run.add_argument("--label", default="label")
    run.add_argument("--epochs", type=int, default=10)
    run.add_argument("--minibatch-size", type=int, default=64)
    run.add_argument("--records-per-task", type=int, default=512)
    run.add_argument("--min-workers", type=int, default=1)
    run.add_argument("--max-workers", type=int, default=2)
    run.add_argument("--num-ps", type=int, default=1)
    run.add_argument("--strategy", default="ps", help="ps or allreduce (see `elastic-step train --help`)")
    run.add_argument("--global-batch", default="scaled", choices=["scaled", "fixed"])
    run.add_argument("--threshold", type=float, default=0.9)
    run.add_argument("--metric", default="accuracy")
    run.add_argument("--eval-fraction", type=float, default=0.2)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--publish-uri", default="", help="where a model that passes the gate is copied")
    run.add_argument("--chaos", action="append", default=[], metavar="ACTION:INSTANCE@RECORDS",
                     help="testing and the demo: disturb the training step on purpose, e.g. kill:worker-0@300000 "
                          "SIGKILLs worker-0 once 300000 records are committed (as `elastic-step train --chaos`; "
                          "also read from ELASTIC_STEP_CHAOS)")
    run.add_argument("--json", action="store_true",
                     help="print the whole result as JSON on stdout (artifacts, metrics, metadata) instead of "
                          "the summary for a person")
    run.set_defaults(func=_pipeline_run, text=_pipeline_text)

    schedule = sub.add_parser("schedule", help="recurring retraining on a KFP cluster").add_subparsers(
        dest="schedule_command", required=True)
    sc = schedule.add_parser("create", help="compile the pipeline and create a KFP recurring run")
    sc.add_argument("--host", required=True, help="KFP API endpoint, e.g. https://kfp.example.com/pipeline")
    sc.add_argument("--cron", required=True, help='6 fields, seconds first: "0 0 2 * * *" is 02:00 daily')
    sc.add_argument("--source", required=True)
    sc.add_argument("--model-def", required=True)
    sc.add_argument("--label", default="label")
    sc.add_argument("--epochs", type=int, default=10)
    sc.add_argument("--minibatch-size", type=int, default=64)
    sc.add_argument("--min-workers", type=int, default=1)
    sc.add_argument("--max-workers", type=int, default=4)
    sc.add_argument("--num-ps", type=int, default=1)
    sc.add_argument("--backend", default="kubernetes")
    sc.add_argument("--worker-image", help="image of the worker/PS pods (default: the runtime image)")
    sc.add_argument("--worker-cpu")
    sc.add_argument("--worker-memory")
    sc.add_argument("--worker-priority-class")
    sc.add_argument("--ps-priority-class")
    sc.add_argument("--threshold", type=float, default=0.9)
    sc.add_argument("--metric", default="accuracy")
    sc.add_argument("--publish-uri", default="")
    sc.add_argument("--experiment", default="elastic-step")
    sc.add_argument("--name", default="elastic-step-train-eval-nightly")
    sc.add_argument("--namespace")
    sc.add_argument("--service-account", help="the runs' service account (it needs the Role in "
                    "components/elastic_train/rbac.yaml for backend kubernetes)")
    sc.add_argument("--pipeline-root", help="where the runs' artifacts go (default: the cluster's)")
    sc.set_defaults(func=_schedule)

    comp = sub.add_parser("compile", help="regenerate the compiled component and pipeline YAMLs")
    comp.add_argument("--root", default=".", help="repository root (components/ and pipelines/ go there)")
    comp.set_defaults(func=_compile)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from elastic_step.util.process import quiet_tensorflow
    quiet_tensorflow()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
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
    json.dump(result, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
