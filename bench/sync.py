"""Synchronous training, whole job: `elastic-step train --strategy allreduce` against TensorFlow's
MultiWorkerMirroredStrategy, side by side in one run, 2 and 3 workers.

    .venv/bin/python bench/sync.py [--model samples/digits/model.py bench/models/digits_cnn.py]
                                   [--workers 2 3] [--runs 3] [--epochs 3] [--tf-steps 1 16] [--before REV]

Both sides: N worker processes on this machine, the same model module (model, loss, optimizer, feed), the same
prepared records (the digits train split repeated to --rows: 60,000 for the MLP, 20,000 for the CNN), minibatch
64 per worker (a global batch of N x 64), the same epochs and seed, evaluated the same way
(elastic_step.evaluation on the held-out eval manifest).

* TensorFlow: `tf.distribute.MultiWorkerMirroredStrategy`, one process per worker, TF_CONFIG on 127.0.0.1
  ports. Keras 3's `fit` fails under it (keras-team/keras#20585), so each worker runs TF's custom-loop
  tutorial path ("Custom training loop with Keras and MultiWorkerMirroredStrategy"): the records in memory
  (the model's feed() on them once), `distribute_datasets_from_function` with each worker a shard, shuffled
  and prefetched; the model and optimizer built under `strategy.scope()`; the loss scaled to the global
  batch; `strategy.run` of the step in a `tf.function`. Tuned as TF's guides advise for small steps: several
  steps per `tf.function` call (a `tf.range` loop over the iterator); the best of --tf-steps is kept.
  Records/s is the global batch x the steps after the first call (tracing, connections) over their span,
  on worker 0.
* elastic-step: `elastic-step train --strategy allreduce --min-workers N --max-workers N`, its defaults
  otherwise (the master's per-epoch evaluation and its checkpoints every 60 s on), tasks of 32 minibatches;
  records/s is its steady state (first to last commit), as in bench/throughput.py.

Sides alternate, --runs times each: this machine's speed drifts over a minute, and a slow moment only ever
slows a run. Printed per model and worker count: each side's best records/s, its spread (slowest over
best), its accuracy (min-max) and elastic-step / best TensorFlow, best against best. `--before REV` adds
elastic-step as the git revision REV has it (its checkout, run by this venv), and this revision's ratio to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from bench.common import digits_prepared, free_ports, revision_tree, splits, train  # noqa: E402

MINIBATCH = 64  # per worker
ROWS = {"samples/digits/model.py": 60_000, "bench/models/digits_cnn.py": 20_000}


# ---------------------------------------------------------------- TensorFlow's side, one process per worker
def mwms_replicas(ports: list[int], index: int, md):
    """Worker `index` of a MultiWorkerMirrored cluster on loopback `ports`: its strategy, and the model module
    `md`'s model and built optimizer under the strategy's scope (what every MultiWorkerMirrored side starts from)."""
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}
    )
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = md.model()
        optimizer = md.optimizer()
        optimizer.build(model.trainable_variables)
    return strategy, model, optimizer


def tf_worker(ports: list[int], index: int, model_path: str, data: str, epochs: int, steps_per_call: int) -> dict:
    import keras
    import tensorflow as tf

    from elastic_step.data.manifest import load_manifest
    from elastic_step.data.reader import read_all
    from elastic_step.evaluation import evaluate
    from elastic_step.model_def import load_model_def

    keras.utils.set_random_seed(0)
    md = load_model_def(model_path)
    x, y = md.feed(read_all(os.path.join(data, "train")))
    strategy, model, optimizer = mwms_replicas(ports, index, md)
    workers = strategy.num_replicas_in_sync

    def dataset_fn(context: tf.distribute.InputContext):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(context.num_input_pipelines, context.input_pipeline_id)
        ds = ds.shuffle(len(y) // workers + 1, seed=0).repeat()
        return ds.batch(context.get_per_replica_batch_size(MINIBATCH * workers)).prefetch(tf.data.AUTOTUNE)

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

    def step_fn(features, labels):
        with tf.GradientTape() as tape:
            # The module's loss is a mean over this worker's minibatch: over the global batch, as the tutorial's
            # compute_average_loss scales it (every replica's minibatch is the same size).
            loss = md.training_loss(model, features, labels) / workers
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_steps(it):
        loss = tf.constant(0.0)
        for _ in tf.range(steps_per_call):
            loss = strategy.run(step_fn, args=next(it))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)

    calls = max(2, epochs * len(y) // (MINIBATCH * workers * steps_per_call))
    train_steps(iterator)  # the first call: tracing, the collective's connections
    t0 = time.perf_counter()
    for _ in range(calls - 1):
        loss = train_steps(iterator)
    float(loss)
    seconds = time.perf_counter() - t0
    weights = [v.numpy() for v in model.weights]
    local = md.model()
    local.set_weights(weights)
    metrics = evaluate(local, md, load_manifest(os.path.join(data, "eval")))
    return {
        "records_per_s": (calls - 1) * steps_per_call * MINIBATCH * workers / seconds,
        "eval": metrics,
        # Every worker's, compared by the bench: the strategy did synchronise them (one model, not N).
        "weights_crc": zlib.crc32(b"".join(np.ascontiguousarray(w, np.float32).tobytes() for w in weights)),
    }


def tensorflow(model_path: str, data: pathlib.Path, workers: int, epochs: int, steps_per_call: int) -> dict:
    ports = free_ports(workers)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--tf-worker",
                json.dumps(ports),
                str(i),
                model_path,
                str(data),
                str(epochs),
                str(steps_per_call),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(workers)
    ]
    try:
        results = []
        for p in procs:
            out, err = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise SystemExit(f"TensorFlow's MultiWorkerMirroredStrategy run failed:\n{err[-4000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        if len({r["weights_crc"] for r in results}) != 1:
            raise SystemExit("TensorFlow's MultiWorkerMirroredStrategy workers ended with different weights")
        return results[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# ---------------------------------------------------------------- elastic-step's side
def elastic(
    model_path: str, data: pathlib.Path, workers: int, epochs: int, out: pathlib.Path, root=ROOT, **values
) -> dict:
    s = train(
        out,
        root=root,
        model_def=model_path,
        **splits(data),
        epochs=epochs,
        minibatch_size=MINIBATCH,
        records_per_task=MINIBATCH * 32,
        strategy="allreduce",
        min_workers=workers,
        max_workers=workers,
        **values,
    )
    # Each worker's own profile of its steps (worker/allreduce/member.py: StepProfile), as its log ends it.
    for log_file in sorted(out.rglob("worker-*.log")):
        for line in log_file.read_text(errors="replace").splitlines():
            if "where my steps' time went" in line:
                print(f"    {log_file.stem}: {line.split('went: ', 1)[-1]}", flush=True)
    return {"records_per_s": s["throughput_records_per_s"], "eval": s["eval"], "summary": s}


def row(model: str, workers: int, side: str, runs: list[dict]) -> str:
    rates, acc = [r["records_per_s"] for r in runs], [r["eval"]["accuracy"] for r in runs]
    return (
        f"{model:>10} {workers:>2} {side:>34} {max(rates):>11.0f} {max(rates) / min(rates):>7.2f} "
        f"{min(acc):.3f}-{max(acc):.3f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=list(ROWS))
    p.add_argument("--workers", type=int, nargs="+", default=[2, 3])
    p.add_argument("--runs", type=int, default=3, help="alternating runs of each side")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rows", type=int, help="records to train on (default: 60,000 for the MLP, 20,000 for the CNN)")
    p.add_argument(
        "--tf-steps",
        type=int,
        nargs="+",
        default=[1, 16],
        help="minibatches per tf.function call on TensorFlow's side; the best is kept",
    )
    p.add_argument("--json", help="also write every run's figures here")
    p.add_argument("--before", metavar="REV", help="also elastic-step at this git revision")
    args = p.parse_args()
    print(
        f"--strategy allreduce against MultiWorkerMirroredStrategy: minibatch {MINIBATCH} per worker, "
        f"{args.epochs} epochs, {args.runs} alternating runs a side; accuracy on the held-out eval split"
    )
    print(f"{'model':>10} {'N':>2} {'side':>34} {'best rec/s':>11} {'spread':>7} {'accuracy':>11}")
    figures = []
    before = f"elastic-step allreduce at {args.before}"
    with contextlib.ExitStack() as stack:
        tree = stack.enter_context(revision_tree(args.before)) if args.before else None
        work = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-sync-")))
        for model_path in args.model:
            rows = args.rows or ROWS.get(model_path, 60_000)
            name = pathlib.Path(model_path).stem.replace("model", "digits_mlp")
            data = digits_prepared(rows, work / f"data-{name}")
            for workers in args.workers:
                sides: dict[str, list[dict]] = {"elastic-step allreduce": []}
                sides.update({f"TF MWMS, {k} step(s)/call": [] for k in args.tf_steps})
                if tree:
                    sides[before] = []
                for run in range(args.runs):
                    sides["elastic-step allreduce"].append(
                        elastic(model_path, data, workers, args.epochs, work / f"out-{name}-{workers}-{run}")
                    )
                    if tree:
                        out = work / f"out-{name}-{workers}-{run}-before"
                        sides[before].append(elastic(model_path, data, workers, args.epochs, out, root=tree))
                    for k in args.tf_steps:
                        sides[f"TF MWMS, {k} step(s)/call"].append(
                            tensorflow(model_path, data, workers, args.epochs, k)
                        )
                for side, runs in sides.items():
                    print(row(name, workers, side, runs), flush=True)
                best = {side: max(r["records_per_s"] for r in runs) for side, runs in sides.items()}
                tf_best = max(v for k, v in best.items() if k.startswith("TF"))
                ratio = best["elastic-step allreduce"] / tf_best
                print(
                    f"{name:>10} {workers:>2} elastic-step / best TF MWMS (best against best): {ratio:.2f}", flush=True
                )
                if tree:
                    than = best["elastic-step allreduce"] / best[before]
                    print(f"{name:>10} {workers:>2} this revision / {args.before} (best against best): {than:.2f}")
                figures.append(
                    {
                        "model": model_path,
                        "rows": rows,
                        "workers": workers,
                        "ratio": ratio,
                        "sides": {
                            s: [{k: v for k, v in r.items() if k != "summary"} for r in runs]
                            for s, runs in sides.items()
                        },
                    }
                )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--tf-worker":
        ports, index, model_path, data, epochs, steps = sys.argv[2:8]
        print(json.dumps(tf_worker(json.loads(ports), int(index), model_path, data, int(epochs), int(steps))))
    else:
        main()
