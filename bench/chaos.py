"""Chaos soak on the local backend: seeded random SIGKILLs and SIGTERMs to workers (and with `--roles`,
to the PS shards and the master), fired on training progress, in both strategies, side by side with
undisturbed runs of the same job.

    .venv/bin/python bench/chaos.py [--runs 3] [--signals 3] [--epochs 40] [--strategies ps allreduce]
                                    [--roles worker,ps,master]

A run whose master was killed or terminated is run again with the same job id and output, as a retry
policy does (the `masters` column counts the masters a run took); allreduce leaves `ps` out of the roles.

Per strategy: one undisturbed digits run, then `--runs` runs under `random:<signals>:seed=<run>`. It
prints, per run, the signals sent, the losses the master saw, the audit's verdict (the PS shards'
own accounting laid over the data set; allreduce has no PS and says so), the records trained again
and the accuracy; then the accuracy spread with chaos against without. The tally model's weights
(tests/models/tally.py) are the other witness: pass `--tally` to train it instead of digits and
check every record's weight against the epochs.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import prepare, run_cli, small_job, summary, train_command  # noqa: E402

DIGITS = ("samples/digits/model.py", "samples/digits/digits.csv")


def run(out: pathlib.Path, data: pathlib.Path, model: str, strategy: str, epochs: int, chaos: str | None) -> dict:
    cmd = train_command(
        *(["--chaos", chaos] if chaos else []),
        **small_job(data, epochs, model),
        output=str(out),
        strategy=strategy,
        job_id=f"chaos-{out.name}",
        **({"num_ps": 2} if strategy == "ps" else {"global_batch": "fixed"}),
    )
    for masters in range(1, 6):  # noqa: B007 - read after it; a retry policy: the master killed or terminated, the step runs again
        proc = run_cli(cmd)
        if proc.returncode not in (-9, 143):
            break
    if proc.returncode != 0:
        raise SystemExit(f"training failed ({strategy}, {chaos}):\n{proc.stderr[-3000:]}")
    return {**summary(out), "masters": masters}


def tally_verdict(out: pathlib.Path, data: pathlib.Path, epochs: int) -> str:
    from tests.models import tally
    from tests.models.witness import train_ids

    rows, dense = tally.tallies(str(out / "model.keras"))
    expected = np.zeros(tally.RECORDS)
    expected[train_ids(str(data / "train"))] = epochs
    wrong = int(((rows != expected) | (dense != expected)).sum())
    return "exact" if wrong == 0 else f"{wrong} wrong"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--signals", type=int, default=3)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--strategies", nargs="+", default=["ps", "allreduce"])
    p.add_argument("--tally", action="store_true", help="train the tally model: weights count applications")
    p.add_argument("--roles", default="worker", help="the signals' targets: worker, ps, master (comma-separated)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp:
        work = pathlib.Path(tmp)
        if args.tally:
            from tests.models import tally

            model, source = "tests/models/tally.py", str(work / "tally.csv")
            tally.write_csv(source)
        else:
            model, source = DIGITS
        prepare(source, work / "data")
        print(
            f"{'tally' if args.tally else 'digits'}, {args.epochs} epochs, 2 workers "
            f"(ps: 2 PS shards; allreduce: --global-batch fixed), random:{args.signals}:seed=<run>:roles={args.roles}"
        )
        header = (
            f"{'strategy':<10}{'run':<6}{'signals':<9}{'kill/term':<11}{'losses':<8}{'masters':<9}{'audit':<13}"
            f"{'tally':<8}{'trained again':<15}{'accuracy':<9}"
        )
        print(header)
        for strategy in args.strategies:
            base = run(work / f"{strategy}-base", work / "data", model, strategy, args.epochs, None)
            accuracies = []
            for i in range(args.runs):
                out = work / f"{strategy}-{i}"
                roles = ",".join(r for r in args.roles.split(",") if strategy == "ps" or r != "ps")
                s = run(
                    out, work / "data", model, strategy, args.epochs, f"random:{args.signals}:seed={i}:roles={roles}"
                )
                fired = s.get("chaos", {}).get("fired", [])
                kinds = f"{sum(f['action'] == 'kill' for f in fired)}/{sum(f['action'] == 'term' for f in fired)}"
                audit = s.get("audit", {}).get("verdict", "no PS")
                tv = tally_verdict(out, work / "data", args.epochs) if args.tally else "-"
                acc = s["eval"].get("accuracy")
                accuracies.append(acc)
                print(
                    f"{strategy:<10}{i:<6}{len(fired):<9}{kinds:<11}{s['workers']['lost']:<8}{s['masters']:<9}"
                    f"{audit:<13}{tv:<8}"
                    f"{s['ledger']['records_trained_again']:<15}{acc if acc is None else f'{acc:.4f}':<9}"
                )
            if accuracies[0] is not None:
                b = base["eval"]["accuracy"]
                print(
                    f"{strategy}: accuracy undisturbed {b:.4f}; with chaos {min(accuracies):.4f}-"
                    f"{max(accuracies):.4f} (median {float(np.median(accuracies)):.4f}, "
                    f"ratio to undisturbed {float(np.median(accuracies)) / b:.3f})"
                )


if __name__ == "__main__":
    main()
