"""What durability costs and what it saves, on the local backend, side by side in one run.

    .venv/bin/python bench/durability.py [--runs 3] [--epochs 600] [--intervals 10s 60s]

1. Throughput with checkpoints every 10 s and every 60 s against none (`--checkpoint-every 0`), the
   runs alternating, best against best (goal: under 3 % cost), with each checkpoint's barrier and
   write times.
2. A PS shard SIGKILLed at 60 % of the job: the time from its loss to training again, and the records
   trained again (those committed after the last checkpoint).
3. The master SIGKILLed at 60 % (a pod lost without warning), and SIGTERMed at 60 % (evicted or
   preempted with a grace period: it cuts a last checkpoint), each step then run again with the same
   job id and output: the time from the new master's start to training again, and the records
   trained again.
Parts 2 and 3 run for each interval (`--losses-only` skips part 1).
4. `--quality N` (instead of 1-3): the model after a loss against the uninterrupted run-to-run spread.
   For seeds 0..N-1, an uninterrupted run, a run with a PS SIGKILLed at 60 %, and a run whose master is
   SIGKILLed at 60 % and then resumed, with checkpoints every first `--intervals` value; it prints each
   kind's final accuracy and loss per seed, and their spreads.
Every run's audit must be exact (the PS shards' accounting laid over the data set).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import prepare, run_cli, small_job, summary, train_command  # noqa: E402
from elastic_step.data.manifest import load_manifest  # noqa: E402


def train(out: pathlib.Path, data: pathlib.Path, epochs: int, every: str, *flags: str, **values) -> tuple[int, dict]:
    """The small job with 1 PS and checkpoints `every`; a SIGKILLed or SIGTERMed master's exit is no failure (its
    summary is then empty)."""
    cmd = train_command(
        *flags,
        output=str(out),
        **small_job(data, epochs),
        num_ps=1,
        job_id="bench-durability",
        checkpoint_every=every,
        **values,
    )
    proc = run_cli(cmd)
    if proc.returncode not in (0, -9, 143) or (proc.returncode == 0 and not (out / "summary.json").exists()):
        raise SystemExit(f"training failed ({every}, {flags}, {values}):\n{proc.stderr[-3000:]}")
    s = summary(out) if proc.returncode == 0 else {}
    if s and s["audit"]["verdict"] != "exact":
        raise SystemExit(f"audit not exact ({every}, {flags}, {values}): {s['audit']}")
    return proc.returncode, s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--epochs", type=int, default=600)
    p.add_argument("--intervals", nargs="+", default=["10s", "60s"])
    p.add_argument("--losses-only", action="store_true", help="skip the throughput runs (parts 2 and 3 only)")
    p.add_argument(
        "--quality",
        type=int,
        default=0,
        metavar="N",
        help="only part 4: N seeds of uninterrupted, PS-loss and master-loss runs, final accuracy",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-durability-") as tmp:
        work = pathlib.Path(tmp)
        prepare("samples/digits/digits.csv", work / "data")
        total = sum(s.rows for s in load_manifest(str(work / "data" / "train")).shards) * args.epochs
        if args.quality:
            quality(work, args, total)
            return
        if not args.losses_only:
            throughput(work, args, total)
        for every in args.intervals:
            losses(work, args.epochs, every, total)


def throughput(work: pathlib.Path, args, total: int) -> None:
    """Part 1: the same job with checkpoints at each interval and with none, alternating."""
    settings = ["0", *args.intervals]
    rates: dict[str, list[float]] = {s: [] for s in settings}
    checkpoints: dict[str, list[dict]] = {s: [] for s in settings}
    accuracy: list[float] = []  # every uninterrupted run's: the spread a run after a loss must stay within
    for run in range(args.runs):
        for every in settings:
            _, s = train(work / f"{every}-{run}", work / "data", args.epochs, every)
            rates[every].append(s["throughput_records_per_s"])
            checkpoints[every] += s["checkpoints"].get("checkpoints", [])
            accuracy.append(s["eval"]["accuracy"])
    print(f"digits, {args.epochs} epochs ({total} records), 2 workers + 1 PS, {args.runs} runs per setting")
    best_none = max(rates["0"])
    print(
        f"{'checkpoints':<14}{'rec/s (runs)':<34}{'best/best':<11}{'cost':<8}{'barrier s (median)':<20}"
        f"{'write s (median)':<18}{'per run':<8}"
    )
    for every in settings:
        best = max(rates[every])
        cks = checkpoints[every]
        hold = statistics.median(c["hold_s"] for c in cks) if cks else 0.0
        write = statistics.median(c["write_s"] for c in cks) if cks else 0.0
        print(
            f"{'none' if every == '0' else 'every ' + every:<14}{' '.join(f'{r:,.0f}' for r in rates[every]):<34}"
            f"{best / best_none:<11.3f}{(1 - best / best_none) * 100:<8.1f}{hold:<20.3f}{write:<18.3f}"
            f"{len(cks) / args.runs:<8.1f}"
        )

    print(f"final accuracy of the {len(accuracy)} uninterrupted runs: {min(accuracy):.4f} - {max(accuracy):.4f}")


def losses(work: pathlib.Path, epochs: int, every: str, total: int) -> None:
    """A PS loss, a master lost without warning, and a master stopped with SIGTERM, all at 60 %."""
    at = int(total * 0.6)
    _, s = train(work / f"ps-loss-{every}", work / "data", epochs, every, "--chaos", f"kill:ps-0@{at}")
    r = s["checkpoints"]["ps_restores"][0]
    print(
        f"PS loss (checkpoints every {every}): loss -> training again {r.get('loss_to_first_commit_s')} s, "
        f"{r['records_trained_again']} records trained again; audit {s['audit']['verdict']}, "
        f"accuracy {s['eval']['accuracy']:.4f}"
    )
    for signal, code in (("kill", -9), ("term", 143)):
        out = work / f"master-{signal}-{every}"
        got, _ = train(out, work / "data", epochs, every, "--chaos", f"{signal}:master@{at}")
        assert got == code, f"the master was not stopped by {signal} (exit {got})"
        cut = json.loads((out / "checkpoints" / "bench-durability" / "checkpoint.json").read_text())[
            "records_committed"
        ]
        _, s = train(out, work / "data", epochs, every)
        r = s["checkpoints"]["restarts"][0]
        print(
            f"master {'SIGKILL' if signal == 'kill' else 'SIGTERM'} (checkpoints every {every}): new master start "
            f"-> training again {r.get('start_to_first_commit_s')} s, {r['records_trained_again']} records "
            f"trained again (stopped at {at}, checkpoint at {cut}); audit {s['audit']['verdict']}, accuracy "
            f"{s['eval']['accuracy']:.4f}"
        )


def quality(work: pathlib.Path, args, total: int) -> None:
    """Part 4: is a model trained through a loss as good as an uninterrupted one, seed for seed?"""
    every, at = args.intervals[0], int(total * 0.6)
    runs: dict[str, list[dict]] = {"uninterrupted": [], "PS SIGKILL": [], "master SIGKILL": []}
    for seed in range(args.quality):
        runs["uninterrupted"].append(train(work / f"q-none-{seed}", work / "data", args.epochs, every, seed=seed)[1])
        runs["PS SIGKILL"].append(
            train(work / f"q-ps-{seed}", work / "data", args.epochs, every, "--chaos", f"kill:ps-0@{at}", seed=seed)[1]
        )
        out = work / f"q-master-{seed}"
        got, _ = train(out, work / "data", args.epochs, every, "--chaos", f"kill:master@{at}", seed=seed)
        assert got == -9, f"the master was not killed (exit {got})"
        runs["master SIGKILL"].append(train(out, work / "data", args.epochs, every, seed=seed)[1])
    print(
        f"digits, {args.epochs} epochs, 2 workers + 1 PS, checkpoints every {every}, losses at 60 %, "
        f"seeds 0-{args.quality - 1}"
    )
    base = [s["eval"]["accuracy"] for s in runs["uninterrupted"]]
    for kind, summaries in runs.items():
        acc = [s["eval"]["accuracy"] for s in summaries]
        loss = [s["eval"]["loss"] for s in summaries]
        print(
            f"{kind:<16} accuracy {' '.join(f'{a:.4f}' for a in acc)} (spread {min(acc):.4f}-{max(acc):.4f}, "
            f"median {statistics.median(acc):.4f}); loss {' '.join(f'{x:.4f}' for x in loss)}; "
            f"|difference from the same seed uninterrupted| max {max(abs(a - b) for a, b in zip(acc, base)):.4f}"
        )


if __name__ == "__main__":
    main()
