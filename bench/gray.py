"""Gray failures on the local backend: a frozen worker against a killed one, and a straggler against its absence.

    .venv/bin/python bench/gray.py [--runs 3] [--strategies ps allreduce] [--hang-timeout 3] [--epochs 3]

Per strategy, side by side in one run, each pair alternating, `--runs` times:
  * freeze against kill: worker-1 frozen with SIGSTOP (`stop:`) mid-training, against worker-1 SIGKILLed at the
    same progress (`kill:`). Figures: from the chaos to its lease remainder leased again (the master's
    timeline: the `chaos` event to the `hung` or `lost` one, plus the ledger's requeue latency; for the freeze,
    the hang bound is most of it; `-` when it held nothing to requeue), the records requeued, and the records
    trained again (ps: minibatches pushed twice, the second
    skipped by the shards; allreduce: committed records the ring rewound). The freeze's bound is
    `--hang-timeout`: the measured one (master/gray/hang.py) has a 30 s floor.
  * a straggler against its absence: 4 workers, one slowed ten times from its start (`slow:worker-3@0:x10`),
    against 3 healthy workers alone. Figure: throughput (records/s between the first and the last commit, the
    master's own), best against best, with the spread (slowest/best), and the master's straggler decisions per run
    (ps: a straggler's work handed over to an idle worker; allreduce: the straggler left out of the ring, replaced,
    and its replacement, as slow, left out for good).
Every run's ledger must come out exact; the bench stops if one does not.

The model is the digits CNN (bench/models/digits_cnn.py) on the digits repeated to `--rows` records: its step is
long enough that a worker slowed ten times is ten times slower, push and pull included.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import digits_prepared, splits, train  # noqa: E402

MODEL = "bench/models/digits_cnn.py"


def job(data: pathlib.Path, strategy: str, epochs: int, workers: int, **extra) -> dict:
    return {
        "model_def": MODEL,
        **splits(data),
        "strategy": strategy,
        "epochs": epochs,
        "minibatch_size": 32,
        "records_per_task": 512,
        "max_workers": workers,
        **({"global_batch": "fixed"} if strategy == "allreduce" else {}),
        **extra,
    }


def exact(s: dict) -> bool:
    return all(e["committed"] == e["records"] and e["double_applied"] == 0 for e in s["ledger"]["epochs"])


def to_released(s: dict) -> float | None:
    """Seconds from the chaos signal to its target's lease remainder leased again (the master's timeline): to the
    master's decision that it is gone (a `hung` or `lost` event), then the ledger's requeue latency."""
    events = s["events"]
    chaos = next((e for e in events if e["kind"] == "chaos"), None)
    gone = next(
        (e["t"] for e in events if chaos and e["kind"] in ("hung", "lost") and e["instance"] == chaos["instance"]), None
    )
    latency = s["recovery"]["requeue_latency_s"]
    return None if gone is None or not latency else gone - chaos["t"] + latency[0]


def retrained(s: dict) -> int:
    dup = s["ledger"]["duplicate_pushes_suppressed"] * s["config"]["minibatch_size"]
    return dup + s["ledger"]["records_trained_again"]


def run(out: pathlib.Path, *flags: str, **values) -> dict:
    s = train(out, *flags, **values)
    if not exact(s):
        raise SystemExit(f"{out.name}: the ledger is not exact: {s['ledger']}")
    return s


def fmt(xs: list[float | None], unit: str = "") -> str:
    got = [x for x in xs if x is not None]
    return " / ".join("-" if x is None else f"{x:.2f}{unit}" for x in xs) + (
        f" (median {statistics.median(got):.2f}{unit})" if got else ""
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--strategies", nargs="+", default=["ps", "allreduce"], choices=["ps", "allreduce"])
    p.add_argument("--hang-timeout", type=float, default=3.0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rows", type=int, default=12_000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-gray-") as tmp:
        work = pathlib.Path(tmp)
        data = digits_prepared(args.rows, work / "data")
        at = args.rows * args.epochs // 2  # mid-training, on progress
        for strategy in args.strategies:
            frozen, killed, slowed, healthy = [], [], [], []
            for r in range(args.runs):
                base = job(data, strategy, args.epochs, 3, hang_timeout=args.hang_timeout)
                frozen.append(run(work / f"{strategy}-stop-{r}", "--chaos", f"stop:worker-1@{at}", **base))
                killed.append(run(work / f"{strategy}-kill-{r}", "--chaos", f"kill:worker-1@{at}", **base))
                four = job(data, strategy, args.epochs, 4)
                slowed.append(run(work / f"{strategy}-slow-{r}", "--chaos", "slow:worker-3@0:x10", **four))
                healthy.append(run(work / f"{strategy}-three-{r}", **job(data, strategy, args.epochs, 3)))
            hung = [e for s in frozen for e in s["events"] if e["kind"] == "hung"]
            print(f"\n{strategy}: digits CNN, {args.rows} records x {args.epochs} epochs, {args.runs} runs each")
            print(f"  freeze -> re-leased (s): {fmt([to_released(s) for s in frozen])}")
            print(f"  kill   -> re-leased (s): {fmt([to_released(s) for s in killed])}")
            bounds = sorted({e["bound_s"] for e in hung})
            print(f"  hangs declared: {len(hung)} of {args.runs} freezes, bound {bounds} s")
            requeued = [sum(e["requeued"] for e in s["ledger"]["epochs"]) for s in frozen + killed]
            print(
                f"  records requeued per freeze / per kill: {requeued[: args.runs]} / {requeued[args.runs :]}; "
                f"trained again: {[retrained(s) for s in frozen]} / {[retrained(s) for s in killed]}"
            )
            rate = [s["throughput_records_per_s"] for s in slowed]
            base_rate = [s["throughput_records_per_s"] for s in healthy]
            decisions = [sum(e["kind"] == "straggler" for e in s["events"]) for s in slowed]
            print(
                f"  throughput, 4 workers one slowed x10: {max(rate):.0f} rec/s (spread {max(rate) / min(rate):.2f}); "
                f"3 healthy workers: {max(base_rate):.0f} rec/s (spread {max(base_rate) / min(base_rate):.2f}); "
                f"ratio {max(rate) / max(base_rate):.2f} (goal >= 0.85); straggler decisions per run: {decisions}"
            )


if __name__ == "__main__":
    main()
