"""One seeded preemption trace replayed on elastic-step and on what a TensorFlow user runs instead: locally, or
on a real control plane where kube-scheduler makes the preemptions (bench/churn_kube.py).

    .venv/bin/python bench/churn.py --backend local                     # every side, none/moderate/heavy, 3 runs
    .venv/bin/python bench/churn.py --backend kubernetes --runs 1       # the same trace as pods and preemptions
    .venv/bin/python bench/churn.py --sides ps psstrategy --churn none heavy --runs 1 --json /tmp/churn.json
    .venv/bin/python bench/churn.py --plot /tmp/churn.json --svg docs/churn   # the table and plots of a --json

The trace: each worker is preempted as a Poisson process in training time, one preemption per worker per 10
minutes of training (moderate) or per 2 minutes (heavy). Time is compressed: the job's undisturbed run stands for
--job-minutes of training, whatever it takes here, and each preemption is keyed to the job's progress (the share
of its target records trained) rather than to the clock, so every side meets the same preemptions at the same
point of its training. Seeded by the run's index: run i of every side replays the same trace.

The local backend (below; the Kubernetes one is described in bench/churn_kube.py): every side fires a preemption
at the first point at or past its records where its worker trains. A side that restarts all its workers makes no
progress while they are down, so it meets every point; an elastic side trains on while a worker comes back, and a
point due to that worker waits for it (without holding back the other worker's): one that is still waiting when
the job reaches its target never fires. Each run reports the preemptions fired against those it was due, and the
table flags a run where they differ.

The sides, each through its public interface, on the same model module, prepared data, minibatch per worker,
workers and target epochs:
  * ps, allreduce: `elastic-step train --strategy ps|allreduce` on the local backend, min 1 worker, the trace as
    `--chaos preempt:worker-N@RECORDS` (SIGKILL once the job has committed RECORDS and worker-N has committed
    since its launch; the master relaunches the worker), a checkpoint an epoch as the peers back up.
  * mwms: TensorFlow's MultiWorkerMirroredStrategy, one process a worker (TF_CONFIG on loopback), on TF's custom
    loop (Keras 3's `fit` fails under the strategy), backed up every epoch by a `tf.train.CheckpointManager` as
    Keras' `BackupAndRestore` does (it is built on one). A lost worker restarts every worker from the last backup,
    as TFJob and Kubeflow Trainer restart a job's pods: the bench plays the operator.
  * psstrategy: TensorFlow's ParameterServerStrategy with a ClusterCoordinator, 1 PS and the workers as
    `tf.distribute.Server` processes on loopback, the coordinator on TF's custom loop (bench/ps_strategy.py's, 16
    minibatches a scheduled function). The coordinator SIGKILLs a worker at the trace's points (its progress: the
    records of the functions it has fetched); the bench restarts the worker on its address at once, as an operator
    restarts a failed pod, and the coordinator's own failure handling reschedules the functions the loss cut.
  * fit: a lone Keras `fit` with `BackupAndRestore` (a backup every epoch, the one before kept against a torn
    write: `double_checkpoint`), restarted from it on its loss; worker 0's trace.
A peer's worker SIGKILLs itself when the trace says so (once its step passes the trace's records); each point
fires once across restarts.

Figures per side and churn rate: time to target (the command's wall time, start-up and restarts included); goodput
= useful worker-seconds / allocated worker-seconds, where a side's workers are allocated for its whole run and its
useful worker-seconds are those its undisturbed run took, so goodput = time without churn / time with it (the same
definition for every side, separate from how fast the side is to begin with); held-out accuracy; records trained
again (elastic-step: its ledger's; mwms and fit: the records trained between the last backup and each loss;
psstrategy: the minibatches its PS applied beyond the target's, counted on the PS, and, apart, the functions TF
logs it put back to run again); the preemptions fired. `--json FILE` writes every run's figures, `--svg PREFIX` a
plot per churn rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from bench.churn_trace import (  # noqa: E402
    CHURN_MINUTES,
    MINIBATCH,
    MODEL,
    SIDES,
    at_records,
    elastic_figures,
    points_due,
    trace,
)
from bench.common import digits_prepared, free_ports, splits, train_command  # noqa: E402


# ---------------------------------------------------------------- elastic-step
def elastic(strategy: str, data: pathlib.Path, rows: int, workers: int, epochs: int, out: pathlib.Path, kills) -> dict:
    chaos = [a for w, r in kills for a in ("--chaos", f"preempt:worker-{w}@{r}")]
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
        max_relaunches=20 + len(kills),  # the default crash-loop guard, on top of the trace's own losses
        # A checkpoint an epoch, as the peers back up: the default 60 s is longer than a compressed job, and an
        # allreduce ring that loses every member goes back to its last checkpoint.
        checkpoint_every=rows,
    )
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"elastic-step train --strategy {strategy} failed:\n{proc.stderr[-3000:]}")
    return elastic_figures(out, wall)


# ---------------------------------------------------------------- the peers: one incarnation of a worker
def write_json(path: str | pathlib.Path, value: dict | list) -> None:
    """`value` to `path` whole or not at all: a reader in another process never sees half of it. Not
    elastic_step.util.json_text.write_json, which fsyncs for durability: a peer writes its progress here ten times
    a second from inside its training loop, and only another process's view of it matters."""
    tmp = pathlib.Path(f"{path}.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def result(cfg: dict, value: dict) -> None:
    """A peer's figures at its end: a JSON line on stdout, and in cfg['result'] when the bench reads them from a
    file (a pod's output goes to its log)."""
    print(json.dumps(value), flush=True)
    if cfg.get("result"):
        write_json(cfg["result"], value)


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

    reported = [0.0]

    def trained(records: int) -> None:
        """After each step: the records the job has trained (worker 0's, for a trace run from outside: Kubernetes),
        then this worker's own death if the trace says so (the local trace)."""
        if index == 0 and cfg.get("progress") and time.monotonic() - reported[0] > 0.1:
            reported[0] = time.monotonic()
            write_json(cfg["progress"], {"records": records})
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
                trained(self.epoch * len(y) + min((batch + 1) * MINIBATCH, len(y)))

        # double_checkpoint, as Keras advises where a kill can land mid-write: a torn backup falls back to the one
        # before. A torn first backup has none, and the job fails for good (churn_kube reports the run as failed).
        backup = keras.callbacks.BackupAndRestore(str(work / "backup"), save_freq="epoch", double_checkpoint=True)
        model.fit(x, y, batch_size=MINIBATCH, epochs=cfg["epochs"], verbose=0, callbacks=[backup, Preemption()])
        result(cfg, {"accuracy": evaluate(model, md, load_manifest(os.path.join(cfg["data"], "eval")))["accuracy"]})
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
        trained((s + 1) * global_batch)
    weights = [v.numpy() for v in model.weights]
    local = md.model()
    local.set_weights(weights)
    accuracy = evaluate(local, md, load_manifest(os.path.join(cfg["data"], "eval")))["accuracy"]
    if index == 0:
        result(cfg, {"accuracy": accuracy, "weights": float(sum(np.sum(w) for w in weights))})


def peer(kind: str, data: pathlib.Path, workers: int, epochs: int, work: pathlib.Path, kills, budget_s: float) -> dict:
    """The peer's job to its end: its processes, all restarted from the backup whenever the trace kills one."""
    work.mkdir(parents=True, exist_ok=True)
    n = 1 if kind == "fit" else workers
    pending = [(w, r) for w, r in kills if w < n]
    again = restarts = 0
    fired = []  # the records at which each of the trace's preemptions fired
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
                "fired_at": fired,
                "restarts": restarts,
            }
        if lost == "budget":
            return {
                "time_to_target_s": None,
                "stalled": True,
                "stalled_at_s": time.perf_counter() - t0,
                "fired_at": fired,
                "restarts": restarts,
            }
        marker = work / "fired.json"
        if not marker.exists():
            raise SystemExit(f"{kind}: a worker failed, not by the trace:\n{outs[procs.index(lost)][1][-3000:]}")
        shot = json.loads(marker.read_text())
        marker.unlink()
        owed = shot["records"]
        pending.remove((shot["worker"], shot["at"]))
        fired.append(shot["records"])
        restarts += 1


# ---------------------------------------------------------------- TensorFlow's ParameterServerStrategy
PS_STEPS_PER_CALL = 16  # minibatches a scheduled function: bench/ps_strategy.py's best, as TF's tutorial advises
PS_IN_FLIGHT = 2  # scheduled functions a worker, so the coordinator always has one queued behind the one running


def ps_chief(cfg: dict) -> None:
    """The coordinator of the `psstrategy` side: TF's custom loop over `coordinator.schedule` (bench/ps_strategy.py's),
    its progress the records of the scheduled functions it has fetched. At a trace's point it SIGKILLs that worker
    (its pid in `pid-<i>`, which the operator rewrites on each restart); the coordinator's own failure handling does
    the rest. A point whose worker is down fires once the coordinator has fetched a function it ran since its
    restart. Prints the figures as a JSON line."""
    import collections
    import logging

    import keras
    import tensorflow as tf

    from bench.ps_strategy import coordinated_training, evaluate_weights
    from elastic_step.data.reader import read_all
    from elastic_step.model_def import load_model_def

    class PutBack(logging.Handler):  # TF tells of a closure to run again only in its log: count those lines
        count = 0

        def emit(self, record):
            PutBack.count += "Putting back a closure" in record.getMessage()

    tf_log = logging.getLogger("tensorflow")
    for h in tf_log.handlers:
        h.setLevel(logging.WARNING)
    tf_log.setLevel(logging.INFO)
    tf_log.addHandler(PutBack())

    work, workers = pathlib.Path(cfg["work"]), len(cfg["cluster"]["worker"])
    keras.utils.set_random_seed(0)
    md = load_model_def(cfg["model"])
    x, y = md.feed(read_all(os.path.join(cfg["data"], "train")))
    coordinator, model, iterator, train_steps, steps = coordinated_training(
        cfg["cluster"], md, x, y, MINIBATCH, PS_STEPS_PER_CALL, seed=0, count_steps=True
    )
    per_call = PS_STEPS_PER_CALL * MINIBATCH
    calls = max(1, cfg["epochs"] * len(y) // per_call)
    pending, fired = [tuple(k) for k in cfg["kills"]], []
    down: dict[int, int] = {}  # a killed worker -> the number of functions scheduled when it was killed
    in_flight: collections.deque = collections.deque()
    scheduled = done = 0
    while done < calls:
        while scheduled < calls and len(in_flight) < PS_IN_FLIGHT * workers:
            in_flight.append((scheduled, coordinator.schedule(train_steps, args=(iterator,))))
            scheduled += 1
        seq, value = in_flight.popleft()
        try:
            ran_on = int(value.fetch()[1])
        except tf.errors.UnavailableError:
            # It completed (its steps are applied) on a worker killed since: its result, left there, went with it.
            ran_on = None
        done += 1
        if cfg.get("progress"):  # for a trace run from outside (Kubernetes)
            write_json(cfg["progress"], {"records": done * per_call})
        if ran_on in down and seq >= down[ran_on]:  # scheduled after the kill: its restarted incarnation ran it
            del down[ran_on]
        for w, at in points_due(pending, done * per_call, set(down)):
            os.kill(int((work / f"pid-{w}").read_text()), signal.SIGKILL)
            pending.remove((w, at))
            down[w] = scheduled
            fired.append({"worker": w, "at": at, "records": done * per_call})
            with open(work / "fired.jsonl", "a") as f:  # for the operator, should the run stall
                f.write(json.dumps(fired[-1]) + "\n")
    coordinator.join()
    result(
        cfg,
        {
            "accuracy": evaluate_weights(md, model, cfg["data"])["accuracy"],
            "closures_put_back": PutBack.count,
            "steps_applied": int(steps.numpy()),
            "steps_needed": calls * PS_STEPS_PER_CALL,
        },
    )


def _failure(work: pathlib.Path) -> str:
    """The coordinator's traceback (its log ends with TF's gRPC complaints at exit, after it), and where its logs
    and the servers' are kept: the run's own directory goes with the bench's."""
    log = (work / "chief.log").read_text()
    kept = pathlib.Path(tempfile.mkdtemp(prefix="churn-psstrategy-failed-"))
    for name in ("chief.log", "servers.log", "fired.jsonl"):
        if (work / name).exists():
            shutil.copy(work / name, kept / name)
    at = log.rfind("Traceback (most recent call last)")
    return (log[at : at + 4000] if at >= 0 else log[-3000:]) + f"\n(the logs: {kept})"


def psstrategy(data: pathlib.Path, workers: int, epochs: int, work: pathlib.Path, kills, budget_s: float) -> dict:
    """TF's ParameterServerStrategy to its end: 1 PS and `workers` workers, `tf.distribute.Server`s, and the
    coordinator (ps_chief), each a local process on loopback. The bench is the operator: a worker that dies is
    started again at once on its address, as a failed pod is; the coordinator reschedules what the loss cut."""
    from bench.ps_strategy import server_command, tf_cluster

    work.mkdir(parents=True, exist_ok=True)
    cluster = tf_cluster(workers)
    logs = open(work / "servers.log", "w")  # the servers' output, closed below

    def launch(job: str, i: int) -> subprocess.Popen:
        proc = subprocess.Popen(server_command(cluster, job, i), cwd=ROOT, stdout=logs, stderr=logs)
        if job == "worker":  # where the coordinator's trace finds the incarnation to kill
            (work / f"pid-{i}.tmp").write_text(str(proc.pid))
            (work / f"pid-{i}.tmp").replace(work / f"pid-{i}")
        return proc

    def fired_at() -> list[int]:
        marks = work / "fired.jsonl"
        return [json.loads(line)["records"] for line in marks.read_text().splitlines()] if marks.exists() else []

    t0 = time.perf_counter()
    ps = launch("ps", 0)
    procs = [launch("worker", i) for i in range(workers)]
    cfg = {"work": str(work), "model": MODEL, "data": str(data), "epochs": epochs, "kills": kills, "cluster": cluster}
    chief_out, chief_log = open(work / "chief.out", "w"), open(work / "chief.log", "w")  # closed below
    chief = subprocess.Popen(
        [sys.executable, __file__, "--ps-chief", json.dumps(cfg)], cwd=ROOT, stdout=chief_out, stderr=chief_log
    )
    restarts = 0
    try:
        while chief.poll() is None:
            if (stalled_at := time.perf_counter() - t0) > budget_s:
                return {
                    "time_to_target_s": None,
                    "stalled": True,
                    "stalled_at_s": stalled_at,
                    "fired_at": fired_at(),
                    "restarts": restarts,
                }
            if ps.poll() is not None:
                raise SystemExit(
                    f"psstrategy: the parameter server died:\n{(work / 'servers.log').read_text()[-3000:]}"
                )
            for i, p in enumerate(procs):
                if p.poll() is not None:  # the operator restarts a failed worker's pod
                    procs[i] = launch("worker", i)
                    restarts += 1
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        if chief.returncode != 0:
            raise SystemExit(f"psstrategy: the coordinator failed (exit {chief.returncode}):\n{_failure(work)}")
    finally:
        for p in [chief, ps, *procs]:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in (logs, chief_out, chief_log):
            f.close()
    r = json.loads((work / "chief.out").read_text().strip().splitlines()[-1])
    return {
        "fired_at": fired_at(),
        "time_to_target_s": wall,
        "accuracy": r["accuracy"],
        "records_trained_again": (r["steps_applied"] - r["steps_needed"]) * MINIBATCH,
        "closures_put_back": r["closures_put_back"],
        "restarts": restarts,
    }


# ---------------------------------------------------------------- the bench
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--backend",
        choices=["local", "kubernetes"],
        default="local",
        help="local: processes, the trace as kills; kubernetes: pods on a real control plane, the trace as "
        "kube-scheduler's preemptions (bench/churn_kube.py)",
    )
    p.add_argument("--churn", nargs="+", default=list(CHURN_MINUTES), choices=list(CHURN_MINUTES))
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--first-run", type=int, default=0, help="the first run's index (its trace's seed): more runs later")
    p.add_argument("--workers", type=int, default=2)
    # 2 epochs of 360,000 records: an epoch stands for 10 training minutes, a backup's interval as long as a real
    # epoch's, where shorter ones would cost a restart little
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rows", type=int, default=360_000, help="the digits train split repeated to this many records")
    p.add_argument("--job-minutes", type=float, default=20.0, help="the training an undisturbed run stands for")
    p.add_argument(
        "--pending-s",
        type=float,
        default=5.0,
        help="kubernetes: mean of the exponential time a preempted worker's slot stays taken",
    )
    p.add_argument("--budget-s", type=float, default=600.0, help="a peer's run past this is reported as stalled")
    p.add_argument("--json", type=pathlib.Path, help="write every run's figures to this file")
    p.add_argument("--svg", type=pathlib.Path, metavar="PREFIX", help="write PREFIX-<churn>.svg, one a churn rate")
    p.add_argument("--plot", type=pathlib.Path, metavar="JSON", help="run nothing: report (and plot) a --json file")
    args = p.parse_args()
    if args.runs < 1 or args.workers < 1 or args.epochs < 1:
        p.error("--runs, --workers and --epochs must be at least 1")
    if args.plot:
        if not args.plot.exists():
            p.error(f"--plot {args.plot}: no such file (write one with --json)")
        results = json.loads(args.plot.read_text())
    else:
        results = run_all(args)
    report(results)
    if args.svg:
        for path in plot(results, args.svg):
            print(f"wrote {path}")


def run_all(args) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(prefix="churn-") as tmp, on_backend(args) as run_side:
        work = pathlib.Path(tmp)
        data = digits_prepared(args.rows, work / "data")
        total = args.rows * args.epochs
        for churn in args.churn:
            for run in range(args.first_run, args.first_run + args.runs):
                kills = at_records(trace(churn, args.workers, args.job_minutes, seed=run), total)
                for side in args.sides:
                    r = run_side(side, data, work / f"{side}-{churn}-{run}", kills, run)
                    # `due`: the trace's preemptions this side has workers for (a lone fit: worker 0's)
                    due = len([k for k in kills if side != "fit" or k[0] == 0])
                    r.update(side=side, churn=churn, run=run, trace=len(kills), due=due, preemptions=len(r["fired_at"]))
                    results.append(r)
                    print(json.dumps(r), flush=True)
                    if args.json:  # as it goes: a run that fails later keeps what was measured
                        write_json(args.json, results)
    return results


@contextlib.contextmanager
def on_backend(args):
    """Yields run_side(side, data, out, kills, seed) -> the run's figures, on the backend args name."""
    if args.backend == "kubernetes":
        from bench.churn_kube import kube_cluster, run_side

        with kube_cluster(args.workers) as (cp, env):
            yield lambda side, data, out, kills, seed: run_side(cp, env, side, data, args, out, kills, seed)
        return

    def local(side, data, out, kills, seed):
        if side in ("ps", "allreduce"):
            return elastic(side, data, args.rows, args.workers, args.epochs, out, kills)
        if side == "psstrategy":
            return psstrategy(data, args.workers, args.epochs, out, kills, args.budget_s)
        return peer(side, data, args.workers, args.epochs, out, kills, args.budget_s)

    yield local


def figures(results: list[dict]) -> list[dict]:
    """Per churn rate and side, in order: best time to target and its runs' range, goodput (the side's best time
    without churn over each run's time: best and range), median accuracy and records trained again, and whether a
    run fired other than the preemptions it was due. A side none of whose runs finished has, if they stalled past a
    budget, `time_over`: its best time was longer than that, so its best goodput was less than `goodput_under`."""
    best_none = {}
    for r in results:
        if r["churn"] == "none" and r["time_to_target_s"]:
            best_none[r["side"]] = min(best_none.get(r["side"], math.inf), r["time_to_target_s"])
    keys = {(r["churn"], r["side"]) for r in results}
    out = []
    for churn, side in sorted(keys, key=lambda k: (list(CHURN_MINUTES).index(k[0]), SIDES.index(k[1]))):
        runs = [r for r in results if r["side"] == side and r["churn"] == churn]
        times = [r["time_to_target_s"] for r in runs if r["time_to_target_s"]]
        f = {"churn": churn, "side": side, "runs": len(runs), "stalled": len(runs) - len(times)}
        f["failed"] = sum(1 for r in runs if r.get("failed"))  # of the stalled: failed for good
        f["fired_differs"] = any(r["preemptions"] != r.get("due", r["trace"]) for r in runs)
        f["fired"] = " ".join(f"{r['preemptions']}/{r.get('due', r['trace'])}" for r in runs)  # run by run
        f["fired_total"] = f"{sum(r['preemptions'] for r in runs)}/{sum(r.get('due', r['trace']) for r in runs)}"
        if times:
            f.update(time_best=min(times), time_worst=max(times))
            if side in best_none:
                f.update(goodput_best=best_none[side] / min(times), goodput_worst=best_none[side] / max(times))
            accs = [r["accuracy"] for r in runs if r.get("accuracy") is not None]
            f["accuracy"] = statistics.median(accs) if accs else None
            f["again"] = statistics.median(r["records_trained_again"] for r in runs if "records_trained_again" in r)
        elif all("stalled_at_s" in r for r in runs):  # none failed for good: each was given up past its budget
            f["time_over"] = min(r["stalled_at_s"] for r in runs)
            if side in best_none:
                f["goodput_under"] = best_none[side] / f["time_over"]
        out.append(f)
    return out


def report(results: list[dict]) -> None:
    """The table: per churn and side, best time to target (spread: worst over best), goodput (best), accuracy,
    records trained again, and the preemptions fired against those due, run by run, `!` where they differ."""
    print(
        f"\n{'side':10s} {'churn':9s} {'time to target':>16s} {'goodput':>8s} {'accuracy':>9s} {'again':>8s}"
        "  preemptions fired/due, run by run"
    )
    for f in figures(results):
        flag = "!" if f["fired_differs"] else " "
        fired = f"{flag} {f['fired']}"
        if "time_best" not in f:
            over = f"> {f['time_over']:.1f} s" if "time_over" in f else ""
            under = f"< {f['goodput_under']:.2f}" if "goodput_under" in f else ""
            gone = _missing(f)
            print(f"{f['side']:10s} {f['churn']:9s} {over or gone:>16s} {under:>8s} {'':>9s} {'':>8s}  {fired}  {gone}")
            continue
        goodput = f"{f['goodput_best']:.2f}" if "goodput_best" in f else "-"
        acc = f"{f['accuracy']:.4f}" if f["accuracy"] is not None else "-"
        spread = f"{f['time_best']:8.1f} s ({f['time_worst'] / f['time_best']:.2f})"
        stalled = f"  {f['stalled']} stalled ({f['failed']} failed)" if f["stalled"] else ""
        print(f"{f['side']:10s} {f['churn']:9s} {spread} {goodput:>8s} {acc:>9s} {f['again']:8.0f}  {fired}{stalled}")
    if any(f["fired_differs"] for f in figures(results)):
        print("! a run fired other than the preemptions it was due: compare its times with care")
    for c in claims(results):
        value = f"{c.get('bounded') or '':1s} {c['value']:.3f}"
        print(f"{c['side']:10s} {c['claim']:48s} {value:>9s}  {'holds' if c['holds'] else 'DOES NOT HOLD'}")


def claims(results: list[dict]) -> list[dict]:
    """What elastic-step claims under churn, each side of it checked on these runs (best against best): at moderate
    churn, at most 1.2x its own time without churn, goodput at least 0.9, at most 0.7x MultiWorkerMirrored's time at
    equal or better accuracy; at heavy churn, goodput at least 2x MultiWorkerMirrored's. Where every mwms run of a
    rate stalled past its budget, its time has a floor, so the ratio has a bound (`bounded`: "<" or ">", the side of
    the value the true ratio is on, the side that keeps the verdict), and accuracy is held against mwms's without
    churn. Each: side, claim, value, bound, holds, bounded."""
    f = {(r["churn"], r["side"]): r for r in figures(results)}
    out = []
    for side in ("ps", "allreduce"):
        none, mod, heavy = (f.get((c, side), {}) for c in ("none", "moderate", "heavy"))
        mwms_none = f.get(("none", "mwms"), {})
        mwms_mod, mwms_heavy = f.get(("moderate", "mwms"), {}), f.get(("heavy", "mwms"), {})
        checks = []  # (claim, value, bound, bounded)
        if "time_best" in none and "time_best" in mod:
            checks.append(
                ("moderate: time / own time without churn <= 1.2", mod["time_best"] / none["time_best"], 1.2, None)
            )
            checks.append(("moderate: goodput >= 0.9", mod["goodput_best"], 0.9, None))
        if "time_best" in mod and "time_best" in mwms_mod:
            checks.append(("moderate: time / mwms's <= 0.7", mod["time_best"] / mwms_mod["time_best"], 0.7, None))
            if mod["accuracy"] is not None and mwms_mod.get("accuracy") is not None:
                checks.append(("moderate: accuracy - mwms's >= 0", mod["accuracy"] - mwms_mod["accuracy"], 0.0, None))
        elif "time_best" in mod and "time_over" in mwms_mod:
            checks.append(("moderate: time / mwms's <= 0.7", mod["time_best"] / mwms_mod["time_over"], 0.7, "<"))
            if mod["accuracy"] is not None and mwms_none.get("accuracy") is not None:
                claim = "moderate: accuracy - mwms's without churn >= 0"
                checks.append((claim, mod["accuracy"] - mwms_none["accuracy"], 0.0, None))
        if "goodput_best" in heavy and "goodput_best" in mwms_heavy:
            checks.append(
                ("heavy: goodput / mwms's >= 2", heavy["goodput_best"] / mwms_heavy["goodput_best"], 2.0, None)
            )
        elif "goodput_best" in heavy and "goodput_under" in mwms_heavy:
            value = heavy["goodput_best"] / mwms_heavy["goodput_under"]
            checks.append(("heavy: goodput / mwms's >= 2", value, 2.0, ">"))
        elif "time_best" in heavy and mwms_heavy.get("stalled") == mwms_heavy.get("runs", 0) > 0:
            checks.append(("heavy: finishes where mwms stalls", 1.0, 1.0, None))
        for claim, value, bound, bounded in checks:
            holds = value <= bound if "<=" in claim else value >= bound
            out.append(
                {"side": side, "claim": claim, "value": value, "bound": bound, "holds": holds, "bounded": bounded}
            )
    return out


COLOURS = {"ps": "#1b7837", "allreduce": "#5aae61", "mwms": "#2166ac", "psstrategy": "#b2182b", "fit": "#762a83"}


def plot(results: list[dict], prefix: pathlib.Path) -> list[pathlib.Path]:
    """PREFIX-<churn>.svg for each churn rate: goodput and time to target per side, a bar the best run, whiskers
    the range of the runs."""
    from bench.plot import bar_panels

    prefix.parent.mkdir(parents=True, exist_ok=True)
    rows = figures(results)
    top_time = 1.15 * max((f["time_worst"] for f in rows if "time_worst" in f), default=1.0)
    top_goodput = max(1.15, 1.15 * max((f["goodput_best"] for f in rows if "goodput_best" in f), default=1.0))
    paths = []
    for churn in [c for c in CHURN_MINUTES if any(f["churn"] == c for f in rows)]:
        here = [f for f in rows if f["churn"] == churn]
        goodput = [_bar(f, "goodput_best", "goodput_worst", "goodput_best") for f in here]
        times = [_bar(f, "time_best", "time_best", "time_worst") for f in here]
        runs = max(f["runs"] for f in here)
        every = CHURN_MINUTES[churn]
        rate = "no preemptions" if every is None else f"a preemption a worker per {every:g} training minutes"
        svg = bar_panels(
            f"Preemptions, {churn} churn: one trace on every side",
            f"{rate}; bar: best of {runs} run(s), whiskers: range; under a side: preemptions fired/due",
            [
                ("goodput (best time without churn / time)", top_goodput, goodput),
                ("time to target, s", top_time, times),
            ],
            COLOURS,
        )
        path = prefix.with_name(f"{prefix.name}-{churn}.svg")
        path.write_text(svg)
        paths.append(path)
    return paths


def _bar(f: dict, value: str, low: str, high: str) -> dict:
    """A side's bar: its figure, the range of its runs, and under its name the preemptions fired of those due."""
    return {
        "name": f["side"],
        "value": f.get(value),
        "low": f.get(low),
        "high": f.get(high),
        "under": f["fired_total"] + (" !" if f["fired_differs"] else ""),  # over its runs: the table has each
        "missing": _missing(f),
    }


def _missing(f: dict) -> str:
    """What stands where a side has no bar."""
    if "time_best" in f:
        return "no run without churn"
    if f["failed"]:
        return "failed"
    return f"stalled > {f['time_over']:.0f} s" if "time_over" in f else "stalled"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--peer-worker":
        peer_worker(sys.argv[2], json.loads(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--ps-chief":
        ps_chief(json.loads(sys.argv[2]))
    else:
        main()
