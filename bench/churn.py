"""One seeded preemption trace replayed on elastic-step and on what a TensorFlow user runs instead, locally.

    .venv/bin/python bench/churn.py --backend local                     # every side, none/moderate/heavy, 3 runs
    .venv/bin/python bench/churn.py --sides ps mwms --churn none moderate --runs 1 --json /tmp/churn.json

The trace: each worker is preempted as a Poisson process in training time, one preemption per worker per 10
minutes of training (moderate) or per 2 minutes (heavy). Time is compressed: the job's undisturbed run stands for
--job-minutes of training, whatever it takes here, and each preemption is keyed to the job's progress (the share
of its target records trained) rather than to the clock, so every side meets the same preemptions at the same
point of its training. Seeded by the run's index: run i of every side replays the same trace.

The sides, each through its public interface, on the same model module, prepared data, minibatch per worker,
workers and target epochs:
  * ps, allreduce: `elastic-step train --strategy ps|allreduce` on the local backend, min 1 worker, the trace as
    `--chaos kill:worker-N@RECORDS` (SIGKILL once the job has committed RECORDS; the master relaunches the worker).
  * mwms: TensorFlow's MultiWorkerMirroredStrategy, one process a worker (TF_CONFIG on loopback), on TF's custom
    loop (Keras 3's `fit` fails under the strategy), backed up every epoch by a `tf.train.CheckpointManager` as
    Keras' `BackupAndRestore` does (it is built on one). A lost worker restarts every worker from the last backup,
    as TFJob and Kubeflow Trainer restart a job's pods: the bench plays the operator.
  * fit: a lone Keras `fit` with `BackupAndRestore` (a backup every epoch), restarted from it on its loss; worker
    0's trace.
A peer's worker SIGKILLs itself when the trace says so (once its step passes the trace's records); each point
fires once across restarts.

Figures per side and churn rate: time to target (the command's wall time, start-up and restarts included); goodput
= useful worker-seconds / allocated worker-seconds, where a side's workers are allocated for its whole run and its
useful worker-seconds are those its undisturbed run took, so goodput = time without churn / time with it (the same
definition for every side, separate from how fast the side is to begin with); held-out accuracy; records trained
again (elastic-step: its ledger's; the peers: the records trained between the last backup and each loss); the
preemptions fired. `--json FILE` writes every run's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from bench.common import digits_prepared, free_ports, splits, summary, train_command  # noqa: E402

SIDES = ("ps", "allreduce", "mwms", "fit")
CHURN_MINUTES = {"none": None, "moderate": 10.0, "heavy": 2.0}  # training minutes between a worker's preemptions
MINIBATCH = 64  # per worker
MODEL = "samples/digits/model.py"


# ---------------------------------------------------------------- the trace
def trace(churn: str, workers: int, job_minutes: float, seed: int) -> list[tuple[int, float]]:
    """(worker, share of the job's records) of every preemption, in order: Poisson per worker in training time."""
    every = CHURN_MINUTES[churn]
    if every is None:
        return []
    rng = random.Random(seed)
    points = []
    for w in range(workers):
        t = rng.expovariate(1.0 / every)
        while t < job_minutes:
            points.append((w, t / job_minutes))
            t += rng.expovariate(1.0 / every)
    return sorted(points, key=lambda p: p[1])


def at_records(points: list[tuple[int, float]], total: int) -> list[tuple[int, int]]:
    return [(w, max(1, int(share * total))) for w, share in points]


# ---------------------------------------------------------------- elastic-step
def elastic(strategy: str, data: pathlib.Path, workers: int, epochs: int, out: pathlib.Path, kills) -> dict:
    chaos = [a for w, r in kills for a in ("--chaos", f"kill:worker-{w}@{r}")]
    cmd = train_command(
        *chaos,
        model_def=MODEL,
        **splits(data),
        epochs=epochs,
        minibatch_size=MINIBATCH,
        records_per_task=MINIBATCH * 16,
        strategy=strategy,
        min_workers=1,
        max_workers=workers,
        output=str(out),
        job_id=f"churn-{out.name}",
    )
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"elastic-step train --strategy {strategy} failed:\n{proc.stderr[-3000:]}")
    s = summary(out)
    return {
        "time_to_target_s": wall,
        "accuracy": s["eval"].get("accuracy"),
        "records_trained_again": s["ledger"]["records_trained_again"],
        "preemptions": len(s.get("chaos", {}).get("fired", [])),
        "audit": s.get("audit", {}).get("verdict", "no PS"),
    }


# ---------------------------------------------------------------- the peers: one incarnation of a worker
def peer_worker(kind: str, cfg: dict) -> None:
    """One process of a peer (`mwms` worker `cfg['index']`, or the lone `fit`) until it ends or the trace kills it.
    Writes `start-<i>.json` (the records its backup restored) and, before it kills itself, `fired.json`."""
    import keras
    import numpy as np
    import tensorflow as tf

    from elastic_step.data.manifest import load_manifest
    from elastic_step.data.reader import read_all
    from elastic_step.evaluation import evaluate
    from elastic_step.model_def import load_model_def

    work = pathlib.Path(cfg["work"])
    index, kills = cfg["index"], [r for w, r in cfg["kills"] if w == cfg["index"]]
    keras.utils.set_random_seed(0)
    md = load_model_def(cfg["model"])
    x, y = md.feed(read_all(os.path.join(cfg["data"], "train")))

    def killed_at(records: int) -> None:
        due = [r for r in kills if r <= records]
        if due:
            (work / "fired.json").write_text(json.dumps({"worker": index, "at": due[0], "records": records}))
            os.kill(os.getpid(), signal.SIGKILL)

    if kind == "fit":
        model = md.model()
        model.compile(optimizer=md.optimizer(), loss=md.loss_fn)

        class Preemption(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.epoch = epoch
                start = work / "start-0.json"
                if not start.exists():  # this incarnation's first epoch: what the backup restored
                    start.write_text(json.dumps({"records": epoch * len(y)}))

            def on_train_batch_end(self, batch, logs=None):
                killed_at(self.epoch * len(y) + min((batch + 1) * MINIBATCH, len(y)))

        backup = keras.callbacks.BackupAndRestore(str(work / "backup"), save_freq="epoch")
        model.fit(x, y, batch_size=MINIBATCH, epochs=cfg["epochs"], verbose=0, callbacks=[backup, Preemption()])
        print(
            json.dumps({"accuracy": evaluate(model, md, load_manifest(os.path.join(cfg["data"], "eval")))["accuracy"]})
        )
        return

    from bench.sync import mwms_replicas

    strategy, model, optimizer = mwms_replicas(cfg["ports"], index, md)
    workers = strategy.num_replicas_in_sync
    with strategy.scope():
        step = tf.Variable(0, dtype=tf.int64, trainable=False)
    global_batch = MINIBATCH * workers
    steps_per_epoch = len(y) // global_batch
    total_steps = steps_per_epoch * cfg["epochs"]
    # Every worker writes the backup, the chief's to the real directory (as BackupAndRestore does under a strategy).
    ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
    chief_dir = str(work / "backup")
    manager = tf.train.CheckpointManager(ckpt, chief_dir if index == 0 else str(work / f"backup-{index}"), 1)
    latest = tf.train.latest_checkpoint(chief_dir)
    if latest:
        ckpt.restore(latest)
    start = int(step.numpy())
    (work / f"start-{index}.json").write_text(json.dumps({"records": start * global_batch}))

    def dataset_fn(context: tf.distribute.InputContext):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(context.num_input_pipelines, context.input_pipeline_id)
        ds = ds.shuffle(len(y) // workers + 1, seed=0, reshuffle_each_iteration=False).repeat()
        return ds.skip(start * MINIBATCH).batch(MINIBATCH).prefetch(tf.data.AUTOTUNE)

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

    def step_fn(features, labels):
        with tf.GradientTape() as tape:
            loss = md.training_loss(model, features, labels) / workers  # over the global batch, as the tutorial
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def train_step(it):
        strategy.run(step_fn, args=next(it))

    for s in range(start, total_steps):
        train_step(iterator)
        if (s + 1) % steps_per_epoch == 0:  # a backup an epoch, BackupAndRestore's default
            step.assign(s + 1)
            manager.save()
        killed_at((s + 1) * global_batch)
    weights = [v.numpy() for v in model.weights]
    local = md.model()
    local.set_weights(weights)
    accuracy = evaluate(local, md, load_manifest(os.path.join(cfg["data"], "eval")))["accuracy"]
    print(json.dumps({"accuracy": accuracy, "weights": float(sum(np.sum(w) for w in weights))}))


def peer(kind: str, data: pathlib.Path, workers: int, epochs: int, work: pathlib.Path, kills, budget_s: float) -> dict:
    """The peer's job to its end: its processes, all restarted from the backup whenever the trace kills one."""
    work.mkdir(parents=True, exist_ok=True)
    n = 1 if kind == "fit" else workers
    pending = [(w, r) for w, r in kills if w < n]
    again = restarts = fired = 0
    owed = None  # the records at the last loss: trained again down to what the next incarnation restores
    t0 = time.perf_counter()
    while True:
        for f in work.glob("start-*.json"):
            f.unlink()
        cfg = {"work": str(work), "model": MODEL, "data": str(data), "epochs": epochs, "kills": pending}
        ports = free_ports(n) if kind == "mwms" else []
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--peer-worker", kind, json.dumps({**cfg, "index": i, "ports": ports})],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(n)
        ]
        lost = None
        while lost is None and any(p.poll() is None for p in procs):
            lost = next((p for p in procs if p.poll() not in (None, 0)), None)
            if time.perf_counter() - t0 > budget_s:
                lost = "budget"
            time.sleep(0.05)
        lost = lost or next((p for p in procs if p.returncode not in (None, 0)), None)
        for p in procs:  # the operator restarts every worker of the job
            if p.poll() is None:
                p.kill()
        outs = [p.communicate() for p in procs]
        if owed is not None and (work / "start-0.json").exists():
            again += owed - json.loads((work / "start-0.json").read_text())["records"]
            owed = None
        if lost is None:
            result = json.loads(outs[0][0].strip().splitlines()[-1])
            return {
                "time_to_target_s": time.perf_counter() - t0,
                "accuracy": result["accuracy"],
                "records_trained_again": again,
                "preemptions": fired,
                "restarts": restarts,
            }
        if lost == "budget":
            return {"time_to_target_s": None, "stalled": True, "preemptions": fired, "restarts": restarts}
        marker = work / "fired.json"
        if not marker.exists():
            raise SystemExit(f"{kind}: a worker failed, not by the trace:\n{outs[procs.index(lost)][1][-3000:]}")
        shot = json.loads(marker.read_text())
        marker.unlink()
        owed = shot["records"]
        pending.remove((shot["worker"], shot["at"]))
        fired += 1
        restarts += 1


# ---------------------------------------------------------------- the bench
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["local"], default="local", help="local only, for now")
    p.add_argument("--churn", nargs="+", default=list(CHURN_MINUTES), choices=list(CHURN_MINUTES))
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rows", type=int, default=24_000, help="the digits train split repeated to this many records")
    p.add_argument("--job-minutes", type=float, default=20.0, help="the training an undisturbed run stands for")
    p.add_argument("--budget-s", type=float, default=600.0, help="a peer's run past this is reported as stalled")
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args()
    if args.runs < 1 or args.workers < 1 or args.epochs < 1:
        p.error("--runs, --workers and --epochs must be at least 1")
    results = []
    with tempfile.TemporaryDirectory(prefix="churn-") as tmp:
        work = pathlib.Path(tmp)
        data = digits_prepared(args.rows, work / "data")
        total = args.rows * args.epochs
        for churn in args.churn:
            for run in range(args.runs):
                kills = at_records(trace(churn, args.workers, args.job_minutes, seed=run), total)
                for side in args.sides:
                    out = work / f"{side}-{churn}-{run}"
                    if side in ("ps", "allreduce"):
                        r = elastic(side, data, args.workers, args.epochs, out, kills)
                    else:
                        r = peer(side, data, args.workers, args.epochs, out, kills, args.budget_s)
                    r.update(side=side, churn=churn, run=run, trace=len(kills))
                    results.append(r)
                    print(json.dumps(r), flush=True)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def report(results: list[dict]) -> None:
    """Per side and churn: best time to target and its spread, goodput against the side's own best without churn."""
    best_none = {
        r["side"]: min(x["time_to_target_s"] for x in results if x["side"] == r["side"] and x["churn"] == "none")
        for r in results
        if r["churn"] == "none"
    }
    print(f"\n{'side':10s} {'churn':9s} {'time to target':>16s} {'goodput':>8s} {'accuracy':>9s} {'again':>8s}")
    keys = sorted({(r["churn"], r["side"]) for r in results}, key=lambda k: (list(CHURN_MINUTES).index(k[0]), k[1]))
    for churn, side in keys:
        runs = [r for r in results if r["side"] == side and r["churn"] == churn]
        times = [r["time_to_target_s"] for r in runs if r["time_to_target_s"]]
        if not times:
            print(f"{side:10s} {churn:9s} {'stalled':>16s}")
            continue
        best = min(times)
        goodput = f"{best_none[side] / best:.2f}" if side in best_none else "-"
        acc = statistics.median(r["accuracy"] for r in runs if r.get("accuracy") is not None)
        again = statistics.median(r["records_trained_again"] for r in runs if "records_trained_again" in r)
        print(f"{side:10s} {churn:9s} {best:8.1f} s ({max(times) / best:.2f}) {goodput:>8s} {acc:9.4f} {again:8.0f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--peer-worker":
        peer_worker(sys.argv[2], json.loads(sys.argv[3]))
    else:
        main()
