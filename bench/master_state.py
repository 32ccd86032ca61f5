"""How big is the master's state at a billion records? The ledger's memory and its part of a checkpoint.

A synthetic job (default 1,000,000,000 records in 1,000 shards, 1,000 records a task: a million tasks an epoch)
is driven in-process to the middle of its second epoch: every task of the first epoch and half of the second
committed, then `--workers` workers each holding a lease partly committed (a third of them a lease ahead too),
and a tenth of them lost (their remainders back in the queue). Then it measures:

- the ledger's memory (tracemalloc: every Python object and numpy array it holds);
- its part of a checkpoint: the cut (taken under the master's lock), its JSON text and write (as the
  Checkpointer writes ledger.json), the file's size;
- a restarted master's restore: reading the file, building the ledger, restoring the cut.

With `--before REV`, the ledger of that git revision (for example the last one that listed every task) is
measured the same way in the same run, side by side (in a child process each, so that one's memory is not the
other's).

    .venv/bin/python bench/master_state.py                       # a billion records, this ledger
    .venv/bin/python bench/master_state.py --records 100000000 --before 5d463a4 --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


LEDGER_PATHS = ("elastic_step/master/leases/ledger.py", "elastic_step/master/ledger.py")  # now, and before


def _ledger_module(rev: str | None):
    """This tree's ledger, or the one of git revision `rev` (loaded under another name)."""
    if rev is None:
        from elastic_step.master.leases import ledger

        return ledger
    for path in LEDGER_PATHS:  # the ledger's place at `rev`: the first that git knows there
        shown = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], capture_output=True, text=True)
        if shown.returncode == 0:
            break
    else:
        raise SystemExit(f"no ledger at revision {rev}: none of {', '.join(LEDGER_PATHS)}")
    source = shown.stdout
    spec = importlib.util.spec_from_loader(f"ledger_{rev}", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def _shards(mod, args):
    per_shard, extra = divmod(args.records, args.shards)
    return [mod.ShardInfo(f"gs://bucket/train/part-{i:05d}", per_shard + (i < extra)) for i in range(args.shards)]


def _drive(ledger, workers: int) -> None:
    """The first epoch whole, half the second, then `workers` partly through a lease, a tenth of them lost."""
    while ledger.epoch == 0:
        lease = ledger.lease("w", 0.0)
        ledger.report("w", lease.task.task_id, lease.task.end)
    for _ in range(ledger.records_per_epoch // ledger.records_per_task // 2):
        lease = ledger.lease("w", 0.0)
        ledger.report("w", lease.task.task_id, lease.task.end)
    for i in range(workers):
        name = f"worker-{i}"
        lease = ledger.lease(name, 1.0)
        half = lease.start + (lease.task.end - lease.start) // 2 // ledger.minibatch_size * ledger.minibatch_size
        ledger.report(name, lease.task.task_id, half)
        if i % 3 == 0:
            ledger.lease(name, 1.0, after=lease.task.task_id)
        if i % 10 == 0:
            ledger.release(name, 2.0)


def measure(args, rev: str | None) -> dict:
    from elastic_step.util.json_text import write_json

    mod = _ledger_module(rev)

    def fresh():
        return mod.Ledger(
            _shards(mod, args), args.records_per_task, epochs=3, minibatch_size=args.minibatch_size, seed=0
        )

    tracemalloc.start()
    t0 = time.perf_counter()
    ledger = fresh()
    built = time.perf_counter() - t0
    _drive(ledger, args.workers)
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    driven = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ledger.json")
        t0 = time.perf_counter()
        cut = ledger.cut()
        cut_s = time.perf_counter() - t0
        write_json(path, {"ledger": cut}, indent=None)
        written_s = time.perf_counter() - t0
        size = os.path.getsize(path)
        committed = ledger.records_committed_total()
        del ledger, cut
        t0 = time.perf_counter()
        with open(path) as f:
            state = json.load(f)
        restored = fresh()
        built_again = time.perf_counter() - t0
        restored.restore(state["ledger"])
        restore_s = time.perf_counter() - t0
    assert restored.records_committed_total() == committed
    return {
        "ledger": rev or "this tree",
        "tasks_per_epoch": restored.records_per_epoch // restored.records_per_task,
        "memory_mb": round(memory / 1e6, 1),
        "cut_s": round(cut_s, 3),
        "cut_and_write_s": round(written_s, 3),
        "size_mb": round(size / 1e6, 2),
        "restore_s": round(restore_s, 3),
        "of_which_new_ledger_s": round(built_again, 3),
        "build_s": round(built, 3),
        "drive_s": round(driven, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=1_000_000_000)
    p.add_argument("--shards", type=int, default=1000)
    p.add_argument("--records-per-task", type=int, default=1000)
    p.add_argument("--minibatch-size", type=int, default=100)
    p.add_argument("--workers", type=int, default=1000, help="workers holding a lease at the cut")
    p.add_argument("--before", metavar="REV", help="also measure the ledger of this git revision")
    p.add_argument("--one", metavar="REV", help=argparse.SUPPRESS)  # a child process: measure one ledger
    p.add_argument("--json", help="write the figures there")
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args, args.one or None)))
        return
    rows = []
    for rev in [args.before, ""] if args.before else [""]:
        child = [sys.executable, __file__, *sys.argv[1:], "--one", rev]
        rows.append(json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout))
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row[k]) for k in keys))
    print(
        f"{args.records:,} records, {rows[-1]['tasks_per_epoch']:,} tasks an epoch, {args.workers} workers holding "
        "leases; target for the ledger's part of a checkpoint: under 100 MB and 2 s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
