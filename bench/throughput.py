"""Training throughput of elastic-step (1 worker + 1 PS, local backend) against Keras `model.fit` on the
same model, data and batch size, measured in the same run: `fit` as it comes (`steps_per_execution=1`),
and `fit` tuned as Keras's docs advise for small steps, at its best `steps_per_execution` (tried:
--spe, default 8 32 128; the best is kept per batch size).

    .venv/bin/python bench/throughput.py [--rows 60000] [--batch 64 256] [--model samples/digits/model.py]
                                         [--pushes-in-flight 2]

elastic-step runs with `--pushes-in-flight 2` unless told otherwise: the opt-in that overlaps the
worker's step with the PS's update (one more update of staleness; the README says what it costs in
accuracy). The default, 1, is about 10 % slower for this lone worker.

elastic-step's figure is its steady state: committed records over the span from the first to the
last commit (process start-up, ~5 s of TensorFlow import, is reported separately). Keras's is the
median epoch of `fit` after a warm-up, so tracing is excluded from both. Both train 3 epochs.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
EPOCHS = 3  # both sides train 3 epochs; Keras's figure is its median epoch, elastic-step's its steady state
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def make_data(rows: int, out: pathlib.Path) -> str:
    """The digits CSV, repeated to `rows`, as one Parquet shard and its manifest."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from elastic_step.data.api import Field, Manifest, Shard

    table = pacsv.read_csv(ROOT / "samples" / "digits" / "digits.csv")
    reps = -(-rows // table.num_rows)
    table = pa.concat_tables([table] * reps).slice(0, rows)
    table = table.take(np.random.default_rng(0).permutation(rows))
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out / "part-00000.parquet", row_group_size=1024)
    m = Manifest(split="train", label="label", shards=[Shard("part-00000.parquet", rows)],
                 schema=[Field(f.name, str(f.type)) for f in table.schema])
    m.save(str(out / "manifest.json"))
    return str(out / "manifest.json")


def keras_fit(model_path: str, manifest: str, batch: int, steps_per_execution: int = 1) -> float:
    import keras

    from elastic_step.data.reader import read_all
    from elastic_step.model_def import load_model_def

    md = load_model_def(model_path)
    x, y = md.feed(read_all(manifest))
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
    return len(y) / statistics.median(times)


def elastic(model_path: str, manifest: str, batch: int, workdir: pathlib.Path, pushes_in_flight: int) -> dict:
    out = workdir / f"elastic-{batch}"
    cmd = [sys.executable, "-m", "elastic_step.cli", "train", "--model-def", model_path, "--train-data", manifest,
           "--output", str(out), "--epochs", str(EPOCHS), "--minibatch-size", str(batch), "--records-per-task",
           str(batch * 32), "--min-workers", "1", "--max-workers", "1", "--num-ps", "1", "--progress", "off",
           "--pushes-in-flight", str(pushes_in_flight)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"elastic-step train failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=60_000)
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--model", default=str(ROOT / "samples" / "digits" / "model.py"))
    p.add_argument("--repeat", type=int, default=3, help="alternating runs of each side per batch size")
    p.add_argument("--pushes-in-flight", type=int, default=2, help="elastic-step's --pushes-in-flight")
    p.add_argument("--spe", type=int, nargs="+", default=[8, 32, 128],
                   help="steps_per_execution values tried for tuned Keras (the best is kept)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        work = pathlib.Path(tmp)
        manifest = make_data(args.rows, work / "data")
        print(f"model {os.path.relpath(args.model, ROOT)}, {args.rows} records, {EPOCHS} epochs; "
              f"elastic-step: 1 worker + 1 PS (local backend), {args.pushes_in_flight} push(es) in flight")
        print(f"{'batch':>6} {'keras fit rec/s':>16} {'tuned fit rec/s (spe)':>22} {'elastic rec/s':>14} "
              f"{'vs fit':>7} {'vs tuned':>8} {'spread fit/tuned/elastic':>25} {'startup s':>10}")
        for batch in args.batch:
            # Alternate the sides, --repeat times each: this VM's speed drifts by tens of percent over a
            # minute, and a slow moment only ever slows a run. Ratios are best against best; the spread
            # is each side's slowest run over its fastest.
            tuned_spe = max(args.spe, key=lambda n: keras_fit(args.model, manifest, batch, n))
            bases, tuned, rates = [], [], []
            for _ in range(args.repeat):
                bases.append(keras_fit(args.model, manifest, batch))
                tuned.append(keras_fit(args.model, manifest, batch, tuned_spe))
                s = elastic(args.model, manifest, batch, work, args.pushes_in_flight)
                rates.append(s["throughput_records_per_s"])
            spread = "/".join(f"{max(v) / min(v):.2f}" for v in (bases, tuned, rates))
            print(f"{batch:>6} {max(bases):>16.0f} {max(tuned):>16.0f} ({tuned_spe:>3}) {max(rates):>14.0f} "
                  f"{max(rates) / max(bases):>7.2f} {max(rates) / max(tuned):>8.2f} {spread:>25} "
                  f"{s['startup_seconds']:>10.1f}", flush=True)


if __name__ == "__main__":
    main()
