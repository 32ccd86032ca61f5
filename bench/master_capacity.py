"""How many workers can one master serve? The real gRPC master against hundreds of simulated workers.

No TensorFlow: each simulated worker is a thread with its own `MasterClient` (its own channel,
as each worker pod has), doing what `elastic_step.worker.loop` does minus the compute:
register, then loop GetTask -> one ReportProgress per minibatch -> ... until DONE (or the run's
time is up). Workers run in a few client *processes* (spawned, so the server process's GIL is
the master's own), over a synthetic ledger (default 2M records, minibatch 64).

The same workload is then driven in-process, with no gRPC, against the Ledger alone and against
the Coordinator (ledger + lock + membership + timeline): the gRPC figures are printed as a ratio
of those, so the cost of the wire and the server's thread pool is visible in one run.

    .venv/bin/python bench/master_capacity.py                    # 200 and 400 workers, <= 60 s
    .venv/bin/python bench/master_capacity.py --workers 100 800 --budget 120 --json out.json

Client processes share the machine with the master, so on a small box the figures are a lower
bound of what the master alone sustains.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TOKEN = "bench-token"


def _percentiles(lat_s: np.ndarray) -> tuple[float, float]:
    if lat_s.size == 0:
        return float("nan"), float("nan")
    p50, p99 = np.percentile(lat_s, [50, 99])
    return float(p50) * 1e3, float(p99) * 1e3


def _ledger(args):
    from elastic_step.master.ledger import Ledger, ShardInfo

    per_shard = args.records // args.shards
    shards = [
        ShardInfo(f"synthetic://{i}", per_shard + (1 if i < args.records % args.shards else 0))
        for i in range(args.shards)
    ]
    return Ledger(
        shards, records_per_task=args.records_per_task, epochs=args.epochs, minibatch_size=args.minibatch, seed=0
    )


def _next_watermark(task_start: int, seq: int, end: int, minibatch: int) -> int:
    return min(end, task_start + ((seq - task_start) // minibatch + 1) * minibatch)


# ---------------------------------------------------------------------------- client processes


def _client_process(address: str, indices: list[int], minibatch: int, think_s: float, ready, start, stop, out) -> None:
    """Run one thread per simulated worker; send back per-thread counts and latencies."""
    from elastic_step.instance.master_client import MasterClient
    from elastic_step.proto import elastic_pb2 as pb

    WAIT, DONE = pb.GetTaskResponse.WAIT, pb.GetTaskResponse.DONE
    results = []
    lock = threading.Lock()
    registered = threading.Barrier(len(indices) + 1)
    # Process-local copies of the parent's events: hundreds of threads polling a process-shared
    # semaphore would measure that instead of the master.
    go, halt = threading.Event(), threading.Event()

    def worker(index: int) -> None:
        client = MasterClient(address, TOKEN, "worker", index)
        get_lat, rep_lat = [], []
        counts = {"tasks": 0, "waits": 0, "done": 0, "reports": 0, "refused": 0, "errors": 0}
        try:
            client.register()
        except Exception:  # noqa: BLE001 - counted, the run goes on
            counts["errors"] += 1
        registered.wait()
        go.wait()
        try:
            while not halt.is_set():
                t0 = time.perf_counter()
                reply = client.get_task()
                get_lat.append(time.perf_counter() - t0)
                if reply.kind == DONE:
                    counts["done"] += 1
                    break
                if reply.kind == WAIT:
                    counts["waits"] += 1
                    time.sleep(reply.retry_after_s or 0.05)
                    continue
                counts["tasks"] += 1
                t = reply.task
                seq = t.start
                while seq < t.end and not halt.is_set():
                    hi = _next_watermark(t.task_start, seq, t.end, minibatch)
                    if think_s:
                        time.sleep(think_s)
                    t0 = time.perf_counter()
                    ok = client.report(t.task_id, hi, hi - seq, 0.0, False)
                    rep_lat.append(time.perf_counter() - t0)
                    counts["reports"] += 1
                    if not ok:
                        counts["refused"] += 1
                        break
                    seq = hi
        except Exception:  # noqa: BLE001 - e.g. the server stopped under us at the deadline
            counts["errors"] += 1
        finally:
            client.close()
            with lock:
                results.append((counts, np.asarray(get_lat, np.float32), np.asarray(rep_lat, np.float32)))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in indices]
    for th in threads:
        th.start()
    registered.wait()
    ready.put(len(indices))
    start.wait()
    go.set()
    while any(th.is_alive() for th in threads):
        if stop.wait(0.05):
            halt.set()
            break
    for th in threads:
        th.join()
    counts = {k: sum(r[0][k] for r in results) for k in results[0][0]} if results else {}
    get_lat = np.concatenate([r[1] for r in results]) if results else np.zeros(0, np.float32)
    rep_lat = np.concatenate([r[2] for r in results]) if results else np.zeros(0, np.float32)
    out.put((counts, get_lat, rep_lat))


def run_grpc(args, workers: int, window_s: float) -> dict:
    from elastic_step.master.coordinator import Coordinator
    from elastic_step.master.service import MasterService, serve

    ledger = _ledger(args)
    coord = Coordinator(ledger, num_ps=0)
    server, port = serve(MasterService(coord, TOKEN, "bench", args.minibatch, "synthetic"))
    address = f"127.0.0.1:{port}"
    ctx = mp.get_context("spawn")  # never fork a process that already runs gRPC
    ready, out = ctx.Queue(), ctx.Queue()
    start, stop = ctx.Event(), ctx.Event()
    nproc = max(1, min(args.client_procs, workers))
    groups = [list(range(p, workers, nproc)) for p in range(nproc)]
    procs = [
        ctx.Process(
            target=_client_process,
            daemon=True,
            args=(address, g, args.minibatch, args.think_ms / 1e3, ready, start, stop, out),
        )
        for g in groups
    ]
    t_setup = time.perf_counter()
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)  # every simulated worker has registered
    setup_s = time.perf_counter() - t_setup

    t0 = time.perf_counter()
    cpu0 = time.process_time()  # this process is the master: its gRPC threads + coordinator
    start.set()
    coord.finished.wait(timeout=window_s)
    elapsed = time.perf_counter() - t0
    master_cpu = time.process_time() - cpu0
    finished = coord.finished.is_set()
    with coord.lock:  # the figures at the end of the window
        committed = ledger.records_committed_total()
    stop.set()
    parts = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    server.stop(None)

    counts = {k: sum(c[k] for c, _, _ in parts) for k in parts[0][0]}
    rpcs = counts["tasks"] + counts["waits"] + counts["done"] + counts["reports"]
    get_lat = np.concatenate([g for _, g, _ in parts])
    rep_lat = np.concatenate([r for _, _, r in parts])
    return {
        "mode": "grpc",
        "workers": workers,
        "client_procs": nproc,
        "setup_s": round(setup_s, 2),
        "elapsed_s": elapsed,
        "finished": finished,
        "records_committed": committed,
        "leases": counts["tasks"],
        "reports": counts["reports"],
        "waits": counts["waits"],
        "refused": counts["refused"],
        "errors": counts["errors"],
        "rpcs": rpcs,
        "master_cpu_s": master_cpu,
        "master_cpu_us_per_rpc": master_cpu / max(1, rpcs) * 1e6,
        "get_task_ms": _percentiles(get_lat),
        "report_ms": _percentiles(rep_lat),
        "all_ms": _percentiles(np.concatenate([get_lat, rep_lat])),
    }


# ---------------------------------------------------------------------------- in-process baselines


def run_inprocess(args, workers: int, window_s: float, with_coordinator: bool) -> dict:
    """The same workload, round-robin over `workers` simulated workers, no gRPC."""
    from elastic_step.backends.api import InstanceId
    from elastic_step.master.coordinator import Coordinator

    ledger = _ledger(args)
    names = [f"worker-{i}" for i in range(workers)]
    if with_coordinator:
        coord = Coordinator(ledger, num_ps=0)
        ids = [InstanceId("worker", i) for i in range(workers)]
        for inst in ids:
            coord.register(inst, "")

        def get_task(i):
            lease = coord.get_task(ids[i])
            return None if lease == "done" else lease

        def report(i, task_id, hi, records):
            return coord.report_progress(ids[i], task_id, hi, 0.0, False)
    else:

        def get_task(i):
            return ledger.lease(names[i], 0.0)

        def report(i, task_id, hi, records):
            ledger.report(names[i], task_id, hi)
            return True

    clock = time.perf_counter
    get_lat, rep_lat = [], []
    seq = [None] * workers  # per worker: (lease fields) or None
    leases = reports = 0
    t0 = clock()
    deadline = t0 + window_s
    while not ledger.done and clock() < deadline:
        for i in range(workers):
            cur = seq[i]
            if cur is None:
                a = clock()
                lease = get_task(i)
                get_lat.append(clock() - a)
                if lease is None:
                    continue
                leases += 1
                cur = seq[i] = [lease.task.task_id, lease.task.start, lease.watermark, lease.task.end]
            task_id, task_start, s, end = cur
            hi = _next_watermark(task_start, s, end, args.minibatch)
            a = clock()
            report(i, task_id, hi, hi - s)
            rep_lat.append(clock() - a)
            reports += 1
            cur[2] = hi
            if hi >= end:
                seq[i] = None
    elapsed = clock() - t0
    get_lat, rep_lat = np.asarray(get_lat), np.asarray(rep_lat)
    return {
        "mode": "coordinator" if with_coordinator else "ledger",
        "workers": workers,
        "elapsed_s": elapsed,
        "finished": ledger.done,
        "records_committed": ledger.records_committed_total(),
        "leases": leases,
        "reports": reports,
        "get_task_ms": _percentiles(get_lat),
        "report_ms": _percentiles(rep_lat),
        "all_ms": _percentiles(np.concatenate([get_lat, rep_lat])),
    }


# ---------------------------------------------------------------------------- report


def _rates(r: dict) -> dict:
    s = max(r["elapsed_s"], 1e-9)
    return {
        "leases_per_s": r["leases"] / s,
        "reports_per_s": r["reports"] / s,
        "records_per_s": r["records_committed"] / s,
    }


def _row(label: str, r: dict, base: dict | None) -> str:
    rt = _rates(r)
    ratio = ""
    if base is not None:
        b = _rates(base)
        ratio = f"{rt['reports_per_s'] / b['reports_per_s']:.4f}" if b["reports_per_s"] else "-"
    return (
        f"{label:<24}{r['elapsed_s']:>8.1f}{'*' if not r['finished'] else ' '}"
        f"{rt['leases_per_s']:>11.0f}{rt['reports_per_s']:>11.0f}{rt['records_per_s']:>12.0f}"
        f"{r['get_task_ms'][0]:>9.3f}{r['get_task_ms'][1]:>9.3f}"
        f"{r['report_ms'][0]:>9.3f}{r['report_ms'][1]:>9.3f}"
        f"{r['all_ms'][0]:>9.3f}{r['all_ms'][1]:>9.3f}{ratio:>10}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[200, 400], help="simulated workers per run")
    p.add_argument("--records", type=int, default=2_000_000)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--minibatch", type=int, default=64)
    p.add_argument("--records-per-task", type=int, default=512)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--client-procs", type=int, default=2, help="processes the worker threads are spread over")
    p.add_argument(
        "--think-ms", type=float, default=0.0, help="simulated compute per minibatch (0: saturate the master)"
    )
    p.add_argument("--budget", type=float, default=60.0, help="upper bound of the whole run, seconds")
    p.add_argument("--baseline-s", type=float, default=3.0, help="window of each in-process baseline")
    p.add_argument("--json", help="also write the raw figures here")
    args = p.parse_args(argv)

    t_start = time.perf_counter()
    print(
        f"master capacity: {args.records:,} records in {args.shards} shards, minibatch {args.minibatch}, "
        f"{args.records_per_task} records/task, {args.epochs} epoch(s); {os.cpu_count()} CPUs; "
        f"client procs {args.client_procs}; think {args.think_ms} ms; budget {args.budget:.0f} s",
        flush=True,
    )
    results = []
    n = len(args.workers)
    overhead = 8.0  # spawn + register + drain + teardown of a gRPC run; then measured
    for k, w in enumerate(args.workers):
        ledger_r = run_inprocess(args, w, args.baseline_s, with_coordinator=False)
        coord_r = run_inprocess(args, w, args.baseline_s, with_coordinator=True)
        # What is left of the budget, shared by the gRPC runs still to go.
        runs_left = n - k
        left = args.budget - (time.perf_counter() - t_start)
        window = (left - runs_left * overhead - (runs_left - 1) * 2 * args.baseline_s) / runs_left
        window = max(2.0, window)
        t_run = time.perf_counter()
        grpc_r = run_grpc(args, w, window)
        overhead = max(2.0, time.perf_counter() - t_run - grpc_r["elapsed_s"]) * 1.2
        results.append((w, ledger_r, coord_r, grpc_r))
        print(
            f"  workers={w}: gRPC window {grpc_r['elapsed_s']:.1f} s (setup {grpc_r['setup_s']} s), "
            f"{grpc_r['records_committed']:,} records committed, waits {grpc_r['waits']}, "
            f"refused {grpc_r['refused']}, errors {grpc_r['errors']}; master process CPU "
            f"{grpc_r['master_cpu_s']:.1f} s = {grpc_r['master_cpu_us_per_rpc']:.0f} us/RPC "
            f"(one core: ~{1e6 / grpc_r['master_cpu_us_per_rpc']:.0f} RPC/s)",
            flush=True,
        )

    hdr = (
        f"{'run':<24}{'secs':>9}{'leases/s':>11}{'reports/s':>11}{'records/s':>12}"
        f"{'get p50':>9}{'get p99':>9}{'rep p50':>9}{'rep p99':>9}{'all p50':>9}{'all p99':>9}"
        f"{'x ledger':>10}"
    )
    print()
    print(hdr)
    print("-" * len(hdr))
    for w, ledger_r, coord_r, grpc_r in results:
        print(_row(f"ledger      W={w}", ledger_r, None))
        print(_row(f"coordinator W={w}", coord_r, ledger_r))
        print(_row(f"gRPC        W={w}", grpc_r, ledger_r))
    print(
        "latencies in ms; '*' = window ended before the ledger was done; "
        "'x ledger' = reports/s relative to the in-process Ledger alone"
    )
    print(f"total {time.perf_counter() - t_start:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"workers": w, "ledger": a, "coordinator": b, "grpc": c} for w, a, b, c in results], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
