"""elastic-step's PS mode against TensorFlow's own parameter-server training, side by side in one run.

    .venv/bin/python bench/ps_strategy.py [--sample digits ctr] [--runs 3] [--epochs 3]

Both sides: 2 workers + 1 PS as local processes on this machine, the same model module (the sample's
model, loss, optimizer and feed), the same prepared records, minibatch, epochs and seed, evaluated the
same way (elastic_step.evaluation on the held-out eval manifest).

* TensorFlow: `tf.distribute.ParameterServerStrategy` with a `ClusterCoordinator` (the chief) and two
  `tf.distribute.Server` workers and one PS. Keras 3 has no parameter-server `fit`, so the chief runs
  TF's custom training loop as its tutorial does: a per-worker dataset (`create_per_worker_dataset`,
  each worker a shard of the records), the model and optimizer built under `strategy.scope()`, and
  `coordinator.schedule` of a `tf.function` that runs `--tf-steps` minibatches per call (the tutorial's
  advice for small steps: fewer round trips to the coordinator; the best of 1 and 16 is kept). Records/s
  is steps x minibatch over the scheduled steps' span, after a warm-up call per worker (tracing).
* elastic-step: `elastic-step train --strategy ps --num-ps 1 --min-workers 2 --max-workers 2`;
  records/s is its steady state (first to last commit), as in bench/throughput.py.

It prints, per sample, each side's best records/s and final eval metrics over `--runs` alternating runs,
with their spread, and the ratio of the bests.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from bench.common import digits_prepared, free_ports, prepare, splits, train  # noqa: E402

SAMPLES = {  # name -> (model module, metric, minibatch)
    "digits": ("samples/digits/model.py", "accuracy", 64),
    "ctr": ("samples/ctr/model.py", "auc", 256),
}
NUM_WORKERS = 2


def make_data(sample: str, rows: int, out: pathlib.Path) -> pathlib.Path:
    """Prepared train and eval manifests: the digits train split repeated to `rows` (its eval split kept
    apart), or `rows` generated CTR records."""
    if sample == "ctr":
        from samples.ctr.generate import generate

        out.mkdir(parents=True, exist_ok=True)
        generate(str(out / "ctr.csv"), rows=rows, seed=0)
        return prepare(str(out / "ctr.csv"), out / "prepared", label="clicked")
    return digits_prepared(rows, out / "prepared")


# ---------------------------------------------------------------- TensorFlow's side, one process per task
# (bench/churn.py's `psstrategy` side runs the same cluster, servers and training loop: one copy of each)
def tf_cluster(workers: int = NUM_WORKERS) -> dict:
    """A cluster spec on free loopback ports: one chief (the coordinator), one PS, `workers` workers."""
    ports = free_ports(workers + 2)
    return {
        "chief": [f"127.0.0.1:{ports[0]}"],
        "ps": [f"127.0.0.1:{ports[1]}"],
        "worker": [f"127.0.0.1:{p}" for p in ports[2:]],
    }


def server_command(cluster: dict, job: str, index: int) -> list[str]:
    """The command line of task `index` of `job` (ps or worker): a `tf.distribute.Server` until it is killed."""
    return [sys.executable, os.path.abspath(__file__), "--tf-server", json.dumps(cluster), job, str(index)]


def tf_server(cluster: dict, job: str, index: int) -> None:
    import tensorflow as tf

    # The tutorial's advice when tasks share few cores: enough inter-op threads for every worker's calls.
    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = len(cluster["worker"]) + 1
    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster), job_name=job, task_index=index, protocol="grpc", config=config, start=True
    )
    server.join()


def coordinated_training(
    cluster: dict, md, x, y, batch: int, steps_per_call: int, seed: int, count_steps: bool = False
):
    """The chief's side of TF's parameter-server training of model module `md` on (x, y), as TF's tutorial
    writes its custom loop: (coordinator, model, iterator, train_steps, steps). `train_steps(iterator)`,
    scheduled with `coordinator.schedule`, runs `steps_per_call` minibatches of `batch` on one worker (each
    worker a shard of the records) and returns (its last loss, the index of the worker that ran it). `steps`:
    with `count_steps`, a variable on the PS that every step applied adds one to, re-runs included; else None."""
    import tensorflow as tf

    workers = len(cluster["worker"])
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc"
    )
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = md.model()
        optimizer = md.optimizer()
        optimizer.build(model.trainable_variables)
        # Not the optimizer's `iterations`: its count came out short of the steps run under concurrent workers.
        steps = tf.Variable(0, dtype=tf.int64, trainable=False) if count_steps else None

    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(context.num_input_pipelines, context.input_pipeline_id)
        return ds.shuffle(len(y) // workers + 1, seed=seed).repeat().batch(batch).prefetch(2)

    @tf.function
    def per_worker_dataset_fn():  # as TF's parameter-server tutorial builds it
        return strategy.distribute_datasets_from_function(dataset_fn)

    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))

    @tf.function
    def train_steps(it):
        def replica_fn(features, labels):
            with tf.GradientTape() as tape:
                loss = md.training_loss(model, features, labels)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        loss = tf.constant(0.0)
        for _ in tf.range(steps_per_call):
            features, labels = next(it)
            loss = strategy.run(replica_fn, args=(features, labels))
            if steps is not None:
                steps.assign_add(1)
        return loss, tf.distribute.coordinator.experimental_get_current_worker_index()

    return coordinator, model, iterator, train_steps, steps


def evaluate_weights(md, model, data: str) -> dict:
    """`model`'s variables (on the PS) copied into a local model of `md`, evaluated on `data`'s eval split."""
    from elastic_step.data.manifest import load_manifest
    from elastic_step.evaluation import evaluate

    local = md.model()
    local.set_weights([v.numpy() for v in model.weights])
    return evaluate(local, md, load_manifest(os.path.join(data, "eval")))


def tf_chief(
    cluster: dict, model_path: str, data: str, batch: int, epochs: int, steps_per_call: int, seed: int
) -> dict:
    import keras

    from elastic_step.data.reader import read_all
    from elastic_step.model_def import load_model_def

    keras.utils.set_random_seed(seed)
    md = load_model_def(model_path)
    x, y = md.feed(read_all(os.path.join(data, "train")))
    coordinator, model, iterator, train_steps, _ = coordinated_training(cluster, md, x, y, batch, steps_per_call, seed)
    calls = max(1, epochs * len(y) // (batch * steps_per_call))
    for _ in range(len(cluster["worker"])):  # warm-up: each worker traces the function
        coordinator.schedule(train_steps, args=(iterator,))
    coordinator.join()
    t0 = time.perf_counter()
    for _ in range(calls):
        coordinator.schedule(train_steps, args=(iterator,))
    coordinator.join()
    seconds = time.perf_counter() - t0
    return {"records_per_s": calls * steps_per_call * batch / seconds, "eval": evaluate_weights(md, model, data)}


def tensorflow(model_path: str, data: pathlib.Path, batch: int, epochs: int, steps_per_call: int, seed: int) -> dict:
    cluster = tf_cluster()
    me = [sys.executable, os.path.abspath(__file__)]
    servers = [
        subprocess.Popen(
            server_command(cluster, job, i), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for job, i in [("ps", 0)] + [("worker", i) for i in range(NUM_WORKERS)]
    ]
    try:
        proc = subprocess.run(
            [
                *me,
                "--tf-chief",
                json.dumps(cluster),
                model_path,
                str(data),
                str(batch),
                str(epochs),
                str(steps_per_call),
                str(seed),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(f"TensorFlow's ParameterServerStrategy run failed:\n{proc.stderr[-4000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        for s in servers:
            s.kill()
            s.wait()


# ---------------------------------------------------------------- elastic-step's side
def elastic(model_path: str, data: pathlib.Path, batch: int, epochs: int, seed: int, out: pathlib.Path) -> dict:
    s = train(
        out,
        model_def=model_path,
        **splits(data),
        epochs=epochs,
        minibatch_size=batch,
        records_per_task=batch * 32,
        strategy="ps",
        num_ps=1,
        min_workers=NUM_WORKERS,
        max_workers=NUM_WORKERS,
        seed=seed,
        checkpoint_every=0,
    )
    return {"records_per_s": s["throughput_records_per_s"], "eval": s["eval"]}


def spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sample", nargs="+", default=list(SAMPLES), choices=list(SAMPLES))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rows", type=int, default=60_000)
    p.add_argument(
        "--tf-steps",
        type=int,
        nargs="+",
        default=[1, 16],
        help="minibatches per scheduled function on TensorFlow's side; the best is kept",
    )
    args = p.parse_args()
    print(f"2 workers + 1 PS, local processes, {args.epochs} epochs, {args.rows} records, {args.runs} runs each")
    print(f"{'sample':>7} {'side':>30} {'best rec/s':>11} {'rec/s spread':>16} {'metric':>8} {'spread':>12}")
    with tempfile.TemporaryDirectory(prefix="bench-ps-strategy-") as tmp:
        work = pathlib.Path(tmp)
        for sample in args.sample:
            model_path, metric, batch = SAMPLES[sample]
            data = make_data(sample, args.rows, work / sample)
            sides: dict[str, list[dict]] = {"elastic-step": []}
            sides.update({f"tf PS strategy, {k} steps/call": [] for k in args.tf_steps})
            for run in range(args.runs):
                sides["elastic-step"].append(
                    elastic(model_path, data, batch, args.epochs, run, work / f"out-{sample}-{run}")
                )
                for k in args.tf_steps:
                    sides[f"tf PS strategy, {k} steps/call"].append(
                        tensorflow(model_path, data, batch, args.epochs, k, run)
                    )
            best = {}
            for side, runs in sides.items():
                rates, scores = [r["records_per_s"] for r in runs], [r["eval"][metric] for r in runs]
                best[side] = max(rates)
                print(
                    f"{sample:>7} {side:>30} {max(rates):>11.0f} {min(rates):>7.0f}-{max(rates):<8.0f} "
                    f"{metric:>8} {spread(scores):>12}",
                    flush=True,
                )
            tf_best = max(v for k, v in best.items() if k != "elastic-step")
            print(
                f"{sample:>7} elastic-step / best TensorFlow PS strategy (best/best): "
                f"{best['elastic-step'] / tf_best:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--tf-server":
        tf_server(json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--tf-chief":
        cluster, model_path, data, batch, epochs, steps, seed = sys.argv[2:9]
        print(
            json.dumps(tf_chief(json.loads(cluster), model_path, data, int(batch), int(epochs), int(steps), int(seed)))
        )
    else:
        main()
