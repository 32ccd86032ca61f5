"""Recovery from a SIGKILLed worker on the local backend: kill → remainder leased again, and
kill → first commit of the replacement worker, against an undisturbed run in the same session.

    .venv/bin/python bench/recovery.py [--kills 3] [--epochs 300]

The kill comes from the master's chaos hook (a real SIGKILL to the worker process); the
figures are the master's own timeline (summary.json `recovery`).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import prepare, small_job, train  # noqa: E402


def run(out: pathlib.Path, data: pathlib.Path, epochs: int, chaos: list[str]) -> dict:
    return train(out, *(a for c in chaos for a in ("--chaos", c)), **small_job(data, epochs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=3)
    # Long enough (about 20 s here) for each replacement to start (~4 s, mostly TensorFlow's import)
    # and commit before the next kill, which waits for full strength.
    p.add_argument("--epochs", type=int, default=300)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        work = pathlib.Path(tmp)
        prepare("samples/digits/digits.csv", work / "data")
        base = run(work / "base", work / "data", args.epochs, [])
        total = base["records_per_epoch"] * args.epochs
        # Kills spread over the run; each waits for the job to be at full strength again.
        chaos = [f"kill:worker-{i % 2}@{int(total * (i + 1) / (args.kills + 2))}" for i in range(args.kills)]
        hit = run(work / "kills", work / "data", args.epochs, chaos)
    relase = hit["recovery"]["requeue_latency_s"]
    first = hit["recovery"]["first_commit_after_loss_s"]
    killed = sum(e["kind"] == "lost" for e in hit["events"])
    if killed < len(chaos) or len(first) < killed:
        print(
            f"NOTE: {killed} of {len(chaos)} kills happened and {len(first)} replacements committed before "
            f"the job ended: raise --epochs for the full figures"
        )
    exact = all(e["committed"] == e["records"] and e["double_applied"] == 0 for e in hit["ledger"]["epochs"])
    print(f"digits, {args.epochs} epochs, 2 workers + 1 PS, {len(chaos)} SIGKILLs: {', '.join(chaos)}")
    print(f"kill -> remainder leased again (s): {relase}  median {statistics.median(relase) if relase else '-'}")
    print(f"kill -> replacement's first commit (s): {first}  median {statistics.median(first) if first else '-'}")
    print(
        f"throughput undisturbed {base['throughput_records_per_s']:.0f} rec/s, with kills "
        f"{hit['throughput_records_per_s']:.0f} rec/s, ratio "
        f"{hit['throughput_records_per_s'] / base['throughput_records_per_s']:.2f}"
    )
    print(
        f"eval accuracy undisturbed {base['eval']['accuracy']:.4f}, with kills {hit['eval']['accuracy']:.4f}; "
        f"ledger exact: {exact}; duplicate pushes suppressed: {hit['ledger']['duplicate_pushes_suppressed']}"
    )


if __name__ == "__main__":
    main()
