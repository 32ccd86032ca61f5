"""Training throughput of elastic-step (1 worker + 1 PS, local backend, default settings) against Keras `model.fit`
on the same model module, prepared records, minibatch and epochs, measured in the same run: `fit` as it comes
(`steps_per_execution=1`), and `fit` tuned as Keras's docs advise for small steps, at its best
`steps_per_execution` (tried once each: --spe, default 8 32 128). Every model of --model is run: by default the
digits CNN (bench/models/digits_cnn.py, most of a step is convolution) and the digits MLP (samples/digits, most of
a step is overhead).

    .venv/bin/python bench/throughput.py [--model M ...] [--rows 20000] [--batch 64] [--repeat 3]
                                         [--minibatches-per-push 8] [--pushes-in-flight 2] [--worker-threads N ...]
                                         [--master-work [--checkpoint-every INTERVAL]] [--scrape] [--profile]
                                         [--before REV]

Each side runs --repeat times, the sides alternating, each round starting one side further on (this VM's speed
drifts by tens of percent over a minute, and a slow moment only ever slows a run); ratios are best against best,
the spread is each side's fastest run over its slowest, and each side's accuracy is on the held-out eval split
(elastic_step.evaluation, as the step's summary scores it), lowest-highest.

Both train 3 epochs, and each side's figure is its whole training at steady state, tracing left out: elastic-step's
the records committed after its first commit over the span from it to the last (the job's summary figure; its
start-up, ~5 s of TensorFlow import, is shown apart), Keras's the records of its 3 epochs over their summed times,
after a warm-up `fit`. Keras's median epoch, which leaves out its slowest epochs, is printed apart for the tuned
side, with the default side's ratio to it; so is the default side against the tuned one round by round (each
round's two runs, close in time: the median and the range). Extra elastic-step sides:
  --minibatches-per-push K  the opt-in that pushes the mean gradient of K minibatches at once (Keras's
                            gradient_accumulation_steps): K times fewer updates, reported apart;
  --pushes-in-flight K      the opt-in that overlaps a step with the PS's update of the K-1 before (each
                            gradient K-1 updates stale), reported apart;
  --worker-threads N ...    the defaults but the worker's TensorFlow intra-op threads, N each (the default side's
                            own is the automatic rule's, master/threads.py: on this backend, the cores shared
                            among the job's workers; its figure says which), so that settings compare in one run;
  --master-work             the same defaults with the master's own work off: no evaluation curve (no eval split)
                            and no checkpoint; with it, every side but this one evaluates after each epoch and
                            cuts a checkpoint an epoch (every --rows committed records), so that some are cut in a
                            short job (the default, every 60 s, would cut none; --checkpoint-every 60s asks for
                            it), and the master's cost is on against off: best against best, and round by round
                            (each round's on run against that round's off run: the median and the range);
  --scrape                  the same defaults with the master's /metrics on a loopback port, read every second by
                            a scraper thread here, as Prometheus would, against the default side (no scraping):
                            best against best, and round by round; each run's scrapes are counted, so a side that
                            was never scraped cannot pass for one that was;
  --before REV              the default side as the revision REV of this repository has it (its checkout, beside
                            this one's, run by this venv), against this one's: best against best, and round by
                            round, so that a change is held to what it changed;
  --profile                 where the default side's time goes, per minibatch, from each process's phase clock
                            (elastic_step/util/phases.py): the training thread, the push and lease threads, the
                            PS's update, the master's reports, evaluations and checkpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
EPOCHS = 3  # both sides train 3 epochs, and each side's figure is over all of them
MODELS = [str(ROOT / "bench" / "models" / "digits_cnn.py"), str(ROOT / "samples" / "digits" / "model.py")]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from bench.common import digits_prepared, free_ports, revision_tree, splits, train  # noqa: E402
from elastic_step.util.phases import ENV as PHASES_ENV  # noqa: E402


def keras_fit(model_path: str, data: pathlib.Path, batch: int, steps_per_execution: int = 1) -> dict:
    import keras

    from elastic_step.data.manifest import load_manifest
    from elastic_step.data.reader import read_all
    from elastic_step.evaluation import evaluate
    from elastic_step.model_def import load_model_def

    md = load_model_def(model_path)
    x, y = md.feed(read_all(str(data / "train")))
    keras.utils.set_random_seed(0)
    model = md.model()
    model.compile(optimizer=md.optimizer(), loss=md.loss_fn, steps_per_execution=steps_per_execution)
    warm = batch * 2 * steps_per_execution
    model.fit(x[:warm], y[:warm], batch_size=batch, epochs=1, verbose=0)  # warm-up: tracing
    times: list[float] = []

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.t0)

    model.fit(x, y, batch_size=batch, epochs=EPOCHS, verbose=0, callbacks=[EpochTimer()])
    accuracy = evaluate(model, md, load_manifest(str(data / "eval")))["accuracy"]
    return {
        "records_per_s": len(y) * len(times) / sum(times),
        "median_epoch_records_per_s": len(y) / statistics.median(times),
        "accuracy": accuracy,
    }


def elastic(
    model_path: str,
    data: pathlib.Path,
    batch: int,
    out: pathlib.Path,
    per_push: int = 1,
    in_flight: int = 1,
    threads: int = 0,
    master_work: bool = True,
    checkpoint_every: str | None = None,
    profile: pathlib.Path | None = None,
    scrape_every_s: float = 0.0,
    root: pathlib.Path = ROOT,
) -> dict:
    """One elastic-step run at default settings but the job's shape; `master_work` off: no eval split, no
    checkpoint (the accuracy is then scored here, on the exported model); `scrape_every_s`: the master's /metrics
    served and read that often for the whole run; `root`: the checkout whose `elastic-step` runs."""
    env = {**os.environ, PHASES_ENV: str(profile)} if profile else None
    values = {} if per_push == 1 else {"minibatches_per_push": per_push}
    if in_flight != 1:
        values["pushes_in_flight"] = in_flight
    if threads:
        values["worker_threads"] = threads
    if checkpoint_every is not None:
        values["checkpoint_every"] = checkpoint_every
    if master_work:
        flags, data_values = ("--prepared", str(data)), {}
    else:
        flags, data_values = (), {"train_data": splits(data)["train_data"], "checkpoint_every": "0"}
    scraper = Scraper(scrape_every_s) if scrape_every_s else None
    if scraper:
        values["health_port"] = scraper.port
    try:
        s = train(
            out,
            *flags,
            env=env,
            root=root,
            model_def=model_path,
            epochs=EPOCHS,
            minibatch_size=batch,
            min_workers=1,
            max_workers=1,
            num_ps=1,
            **values,
            **data_values,
        )
    finally:
        scrapes = scraper.stop() if scraper else []
    accuracy = s["eval"]["accuracy"] if master_work else saved_accuracy(model_path, data, out)
    return {
        "records_per_s": s["throughput_records_per_s"],
        "accuracy": accuracy,
        "startup_s": s["startup_seconds"],
        "summary": s,
        "scrapes": scrapes,
    }


class Scraper:
    """Reads http://127.0.0.1:<port>/metrics every `every_s` on a thread of its own, as Prometheus would, from now
    until `stop`; a refused connection (the master not up yet, or gone) is a scrape missed."""

    def __init__(self, every_s: float):
        (self.port,) = free_ports(1)
        self.every_s, self.took_s = every_s, []  # each scrape's time, answer read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        url = f"http://127.0.0.1:{self.port}/metrics"
        while not self._stop.wait(self.every_s):
            began = time.perf_counter()
            try:
                with urllib.request.urlopen(url, timeout=self.every_s) as answer:
                    if b"elastic_step_records_committed_total" in answer.read():
                        self.took_s.append(time.perf_counter() - began)
            except OSError:
                pass

    def stop(self) -> list[float]:
        """Stop scraping; the times of the scrapes that read the step's metrics."""
        self._stop.set()
        self._thread.join()
        return self.took_s


def saved_accuracy(model_path: str, data: pathlib.Path, out: pathlib.Path) -> float:
    """The eval split's accuracy of the model a run exported (for a run with no eval split of its own)."""
    from elastic_step.data.manifest import load_manifest
    from elastic_step.evaluation import evaluate
    from elastic_step.model_def import load_model_def
    from elastic_step.model_io import load_model

    md = load_model_def(model_path)
    return evaluate(load_model(str(out), md), md, load_manifest(str(data / "eval")))["accuracy"]


def show_profile(profile: pathlib.Path, minibatches: int, rate: float, batch: int) -> None:
    """Each process's phases, in microseconds per minibatch (and the CPU their own thread took), beside the step's
    whole time per minibatch; then each process's CPU by thread name."""
    whole = 1e6 * batch / rate
    print(f"  where a minibatch's time goes, in µs per minibatch (one minibatch: {whole:.0f} µs at this run's rate):")
    for path in sorted(profile.glob("*.json")):
        for name, v in sorted(json.loads(path.read_text()).items(), key=lambda kv: -kv[1]["s"]):
            cpu = f", its thread's CPU {1e6 * v['cpu'] / minibatches:.0f} µs" if "cpu" in v else ""
            each = "threads" if name.startswith("CPU of its threads") else "times"
            print(f"    {path.stem:>9} {name:<62} {1e6 * v['s'] / minibatches:>9.0f} µs  ({v['n']} {each}{cpu})")


def round_by_round(a: list[dict], b: list[dict]) -> list[float]:
    """Each round's run of side a over its run of side b, sorted. A round's runs are close in time: their ratio
    leaves out the machine's drift between rounds, which best against best (each side's fastest moment, maybe
    minutes apart) does not."""
    return sorted(x["records_per_s"] / y["records_per_s"] for x, y in zip(a, b))


def cost(what: str, on: list[dict], off: list[dict]) -> str:
    """What `what` costs training: side `on` (with it) against side `off` (without), best against best and round
    by round."""
    best_on, best_off = (max(r["records_per_s"] for r in rs) for rs in (on, off))
    paired = sorted(1 - r for r in round_by_round(on, off))
    return (
        f"  {what} costs training {1 - best_on / best_off:+.1%} best against best (on {best_on:.0f} / off "
        f"{best_off:.0f}); round by round {statistics.median(paired):+.1%} median, {paired[0]:+.1%} to "
        f"{paired[-1]:+.1%}"
    )


def compare(model: str, batch: int, data: pathlib.Path, work: pathlib.Path, args) -> None:
    """Every side on `model` at minibatch `batch`, alternating; prints the table (and the profile)."""
    name = os.path.relpath(model, ROOT)
    tag = f"{name.replace('/', '_')}-{batch}"
    # One an epoch unless asked otherwise: a job of seconds cuts some (the job's default, every 60 s, none).
    checkpoints = (args.checkpoint_every or str(args.rows)) if args.master_work else None
    tuned_spe = max(args.spe, key=lambda n: keras_fit(model, data, batch, n)["records_per_s"])
    fit, tuned, default = "keras fit", f"keras fit, steps_per_execution={tuned_spe}", "elastic-step"

    def run_elastic(i: int, side: str, **kw):
        return elastic(model, data, batch, work / f"{tag}-{side.replace(' ', '_')}-{i}", **kw)

    sides = {
        fit: lambda i: keras_fit(model, data, batch),
        tuned: lambda i: keras_fit(model, data, batch, tuned_spe),
        default: lambda i: run_elastic(
            i, default, checkpoint_every=checkpoints, profile=work / f"profile-{tag}-{i}" if args.profile else None
        ),
    }
    for k in args.minibatches_per_push:
        side = f"elastic-step, {k} minibatches/push"
        sides[side] = lambda i, k=k, side=side: run_elastic(i, side, per_push=k, checkpoint_every=checkpoints)
    for k in args.pushes_in_flight:
        side = f"elastic-step, {k} pushes in flight"
        sides[side] = lambda i, k=k, side=side: run_elastic(i, side, in_flight=k, checkpoint_every=checkpoints)
    for k in args.worker_threads:
        side = f"elastic-step, {k} worker thread{'s' * (k > 1)}"
        sides[side] = lambda i, k=k, side=side: run_elastic(i, side, threads=k, checkpoint_every=checkpoints)
    off = "elastic-step, master's work off"
    if args.master_work:
        sides[off] = lambda i: run_elastic(i, off, master_work=False)
    scraped = "elastic-step, /metrics read every 1 s"
    if args.scrape:
        sides[scraped] = lambda i: run_elastic(i, scraped, checkpoint_every=checkpoints, scrape_every_s=1.0)
    before = f"elastic-step at {args.before}"
    if args.before:
        sides[before] = lambda i: run_elastic(i, before, checkpoint_every=checkpoints, root=args.before_tree)
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    order = list(sides)
    for i in range(args.repeat):
        # Each round starts one side further on, so that no side always runs right after the same other: what a
        # run leaves behind (its files written back, its processes ending) must not weigh on one side only.
        for side in order[i % len(order) :] + order[: i % len(order)]:
            runs[side].append(sides[side](i))
    best = {side: max(r["records_per_s"] for r in rs) for side, rs in runs.items()}
    print(
        f"\n{name}, batch {batch}\n"
        f"{'side':>40} {'best rec/s':>11} {'spread':>7} {'accuracy':>13} {'vs fit':>7} {'vs tuned':>8} "
        f"{'startup s':>10}"
    )
    for side, rs in runs.items():
        rates, accuracy = [r["records_per_s"] for r in rs], [r["accuracy"] for r in rs]
        startup = f"{min(r['startup_s'] for r in rs):.1f}" if "startup_s" in rs[0] else ""
        print(
            f"{side:>40} {best[side]:>11.0f} {max(rates) / min(rates):>7.2f} "
            f"{min(accuracy):.3f}-{max(accuracy):.3f} {best[side] / best[fit]:>7.2f} "
            f"{best[side] / best[tuned]:>8.2f} {startup:>10}",
            flush=True,
        )
    median_epoch = max(r["median_epoch_records_per_s"] for r in runs[tuned])
    print(
        f"  {tuned} by its median epoch instead (its best run): {median_epoch:.0f} rec/s; {default} against it: "
        f"{best[default] / median_epoch:.2f}"
    )
    rounds = round_by_round(runs[default], runs[tuned])
    print(
        f"  {default} against {tuned} round by round: {statistics.median(rounds):.2f} median, {rounds[0]:.2f} to "
        f"{rounds[-1]:.2f}"
    )
    pools = {
        tuple(r["summary"]["config"].get(f"worker_{p}_op_threads") for p in ("intra", "inter")) for r in runs[default]
    }
    print(
        "  the default side's worker ran "
        + " or ".join(f"{intra} intra-op and {inter} inter-op thread(s)" for intra, inter in sorted(pools, key=str))
    )
    if args.master_work:
        print(cost("the master's own work", runs[default], runs[off]))
    if args.scrape:
        print(cost("reading /metrics every second", runs[scraped], runs[default]))
        took = sorted(t for r in runs[scraped] for t in r["scrapes"])
        counts = ", ".join(str(len(r["scrapes"])) for r in runs[scraped])
        print(
            f"  scrapes that read the step's metrics, each run: {counts}; each took "
            f"{1e3 * statistics.median(took):.1f} ms median, {1e3 * took[-1]:.1f} ms at most (the answer read)"
        )
    if args.before:
        print(cost(f"this revision, against {args.before},", runs[default], runs[before]))
    if args.profile:
        top = max(range(len(runs[default])), key=lambda j: runs[default][j]["records_per_s"])
        rate = runs[default][top]["records_per_s"]
        show_profile(work / f"profile-{tag}-{top}", args.rows * EPOCHS // batch, rate, batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=MODELS)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--batch", type=int, nargs="+", default=[64])
    p.add_argument("--repeat", type=int, default=3, help="alternating runs of each side")
    p.add_argument("--minibatches-per-push", type=int, nargs="*", default=[8], help="opt-in sides, apart")
    p.add_argument("--pushes-in-flight", type=int, nargs="*", default=[2], help="opt-in sides, apart")
    p.add_argument(
        "--worker-threads", type=int, nargs="*", default=[], help="sides at these worker intra-op threads, apart"
    )
    p.add_argument("--spe", type=int, nargs="+", default=[8, 32, 128], help="steps_per_execution tried for tuned fit")
    p.add_argument("--master-work", action="store_true", help="a side with the master's evaluation and checkpoints off")
    p.add_argument(
        "--checkpoint-every",
        default="",
        help="with --master-work: the sides' checkpoint_every (default: --rows, one an epoch; 60s: the job's default)",
    )
    p.add_argument("--scrape", action="store_true", help="a side whose master's /metrics is read every second")
    p.add_argument("--profile", action="store_true", help="the phase profile of the default side's best run")
    p.add_argument("--before", metavar="REV", help="a side of the default settings at this git revision")
    args = p.parse_args()
    with contextlib.ExitStack() as stack:
        args.before_tree = stack.enter_context(revision_tree(args.before)) if args.before else None
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-throughput-"))
        work = pathlib.Path(tmp)
        data = digits_prepared(args.rows, work / "data")
        print(
            f"{args.rows} records, {EPOCHS} epochs, {args.repeat} alternating runs a side; elastic-step: 1 worker + "
            "1 PS (local backend) at default settings"
            + (
                f", a checkpoint every {args.checkpoint_every or f'{args.rows} records (an epoch)'}"
                if args.master_work
                else ""
            )
            + "; accuracy on the held-out eval split, lowest-highest"
        )
        for model in args.model:
            for batch in args.batch:
                compare(model, batch, data, work, args)


if __name__ == "__main__":
    main()
