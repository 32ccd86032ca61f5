"""How many workers can one master serve? The real gRPC master against thousands of simulated workers.

No TensorFlow: each simulated worker is a coroutine with its own grpc.aio channel (as each worker pod has its
own connection), many to a client process, doing what `elastic_step.worker.ps.loop` does minus the compute:
register (coming back when the master says so), then lease after lease, a report at the master's pace and at
each lease's end, until DONE or the window ends. Register, GetTask and ReportProgress go on the worker's Session
stream, as MasterClient sends them (--unary: as unary calls, the path before the stream).
Client processes are spawned, so the server process's CPU is the master's own; the bench prints the clients' CPU
beside it. All workers start at once (--ramp-s spreads them).

The same workload is then driven in-process, with no gRPC, against the Ledger alone and against the Coordinator
(ledger + lock + membership + timeline): the gRPC figures are printed as a ratio of those.

    .venv/bin/python bench/master_capacity.py                                  # 1,000 saturating workers
    .venv/bin/python bench/master_capacity.py --workers 1000 4000 10000 --leases-per-worker 4 --client-procs 2
    .venv/bin/python bench/master_capacity.py --workers 10000 --think-ms 100 --records-per-task 16384 \
        --leases-per-worker 2 --client-procs 2 --window 90                     # paced: 100 ms a minibatch

Client processes share the machine with the master, so on a small box the figures are a lower bound of what the
master alone sustains.

`--before REV` runs, after each gRPC run, the same run as the git revision REV has this bench and the master (its
checkout, run by this venv), and prints this revision's records/s and master CPU a call against it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
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


def _records(args, workers: int) -> int:
    return workers * args.records_per_task * args.leases_per_worker if args.leases_per_worker else args.records


def _ledger(args, workers: int):
    from elastic_step.master.leases.ledger import Ledger, ShardInfo

    records = _records(args, workers)
    per_shard = records // args.shards
    shards = [
        ShardInfo(f"synthetic://{i}", per_shard + (1 if i < records % args.shards else 0)) for i in range(args.shards)
    ]
    return Ledger(
        shards, records_per_task=args.records_per_task, epochs=args.epochs, minibatch_size=args.minibatch, seed=0
    )


def _next_watermark(task_start: int, seq: int, end: int, minibatch: int) -> int:
    return min(end, task_start + ((seq - task_start) // minibatch + 1) * minibatch)


# ---------------------------------------------------------------------------- client processes


class _UnaryCalls:
    """A simulated worker's Register, GetTask and ReportProgress as unary calls: the master's path before
    Session, kept for comparison (--unary)."""

    def __init__(self, stub):
        self.stub = stub

    async def call(self, kind: str, request, timeout: float):
        methods = {"register": self.stub.Register, "get_task": self.stub.GetTask, "report": self.stub.ReportProgress}
        return await methods[kind](request, timeout=timeout)

    def close(self) -> None:
        pass


class _SessionCalls:
    """A simulated worker's calls on its Session stream, as MasterClient sends them (one stream per worker, calls
    numbered, each reply read as instance.master_client.answer reads it), one call at a time on asyncio instead of
    a thread per stream."""

    def __init__(self, stub):
        from elastic_step.proto.rpc import SESSION_DEADLINE_S

        self.stream = stub.Session(timeout=SESSION_DEADLINE_S)  # the master measures its queue from it
        self.ids = 0

    async def call(self, kind: str, request, timeout: float):
        import grpc

        from elastic_step.instance.master_client import CallError, answer
        from elastic_step.proto import elastic_pb2 as pb

        self.ids += 1
        async with asyncio.timeout(timeout):
            await self.stream.write(pb.SessionCall(id=self.ids, **{kind: request}))
            reply = await self.stream.read()
        if reply is grpc.aio.EOF:
            raise CallError(grpc.StatusCode.UNAVAILABLE, "the master ended the stream")
        assert reply.id == self.ids, (reply.id, self.ids)
        return answer(reply, kind)

    def close(self) -> None:
        self.stream.cancel()


async def _simulated_worker(address, index, minibatch, think_s, unary, halt, stats) -> None:
    """One worker as elastic_step.worker.ps.loop drives the master, minus the compute, on its Session stream:
    register, then lease after lease, a report at most every `report_interval_s` (the master's pace) and at each
    lease's end, honouring every "come back after" the master answers."""
    import grpc

    from elastic_step.proto import elastic_pb2 as pb
    from elastic_step.proto import elastic_pb2_grpc as pb_grpc
    from elastic_step.proto.rpc import CALL_TIMEOUT_S

    loop = asyncio.get_running_loop()
    clock = loop.time
    me = pb.Instance(role="worker", index=index)
    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.MasterStub(channel)
    calls = _UnaryCalls(stub) if unary else _SessionCalls(stub)
    started = clock()  # the first-lease clock starts at the first try to register
    try:
        while True:  # a master at its limit answers "come back after" instead of registering now
            stats["rpcs"] += 1
            reg = await calls.call("register", pb.RegisterRequest(token=TOKEN, instance=me), CALL_TIMEOUT_S)
            if not reg.retry_after_s:
                break
            stats["backoffs"] += 1
            await asyncio.sleep(reg.retry_after_s)
            if halt.is_set():
                return
        interval = reg.report_interval_s or 0.05
        first = True
        while not halt.is_set():
            t0 = clock()
            stats["rpcs"] += 1
            reply = await calls.call("get_task", pb.GetTaskRequest(token=TOKEN, instance=me), CALL_TIMEOUT_S)
            stats["get_lat"].append(clock() - t0)
            if reply.kind == pb.GetTaskResponse.DONE:
                break
            if reply.kind == pb.GetTaskResponse.WAIT:
                stats["waits"] += 1
                await asyncio.sleep(reply.retry_after_s or 0.05)
                continue
            stats["leases"] += 1
            if first:
                stats["first_lease"].append(clock() - started)
                first = False
            t = reply.task
            seq = t.start
            acked = seq  # the records below are committed: the clients' own tally, next to the ledger's
            # The minibatches between two reports (the pace, and each lease's last), computed in one sleep: a
            # wake-up per minibatch would make the clients, not the master, the bottleneck.
            batches = max(1, int(interval / think_s)) if think_s else 1 << 30
            while seq < t.end and not halt.is_set():
                done = 0
                while done < batches and seq < t.end:
                    seq = _next_watermark(t.task_start, seq, t.end, minibatch)
                    done += 1
                if think_s:
                    await asyncio.sleep(done * think_s)
                t0 = clock()
                stats["rpcs"] += 1
                progress = pb.ProgressReport(token=TOKEN, instance=me, task_id=t.task_id, watermark=seq)
                rep = await calls.call("report", progress, CALL_TIMEOUT_S)
                stats["rep_lat"].append(clock() - t0)
                stats["reports"] += 1
                stats["tallied"] += 0 if rep.stop else seq - acked
                acked = seq
                if rep.stop:
                    stats["refused"] += 1
                    break
    except (grpc.RpcError, TimeoutError) as e:
        code = e.code() if isinstance(e, grpc.RpcError) else grpc.StatusCode.DEADLINE_EXCEEDED
        if halt.is_set() and code == grpc.StatusCode.CANCELLED:
            return  # the run is over: its channel closed under a call in flight
        details = e.details() if isinstance(e, grpc.RpcError) else "no reply on the stream"
        stats["errors"] += 1
        stats["error_codes"][code.name] = stats["error_codes"].get(code.name, 0) + 1
        stats["errors_seen"].append(f"{code.name}: {details} at {clock() - started:.1f} s")
    finally:
        calls.close()
        await channel.close()


def _client_process(address, indices, minibatch, think_s, unary, ramp_s, ready, start, stop, out) -> None:
    """Many simulated workers on one asyncio loop: a worker costs a coroutine and a channel, not a thread, so the
    clients' CPU stays small next to the master's. Sends back the counts, latencies and this process's CPU."""
    asyncio.run(_clients(address, indices, minibatch, think_s, unary, ramp_s, ready, start, stop, out))


async def _clients(address, indices, minibatch, think_s, unary, ramp_s, ready, start, stop, out) -> None:
    loop = asyncio.get_running_loop()
    stats = {
        "rpcs": 0, "leases": 0, "tallied": 0, "waits": 0, "reports": 0, "refused": 0, "errors": 0, "backoffs": 0,
        "get_lat": [], "rep_lat": [], "first_lease": [], "error_codes": {}, "errors_seen": [],
    }  # fmt: skip
    halt = asyncio.Event()
    ready.put(len(indices))
    await loop.run_in_executor(None, start.wait)
    cpu0 = time.process_time()
    tasks = []
    for i in indices:  # registrations spread over `ramp_s` (0: a burst, all at once)
        tasks.append(asyncio.create_task(_simulated_worker(address, i, minibatch, think_s, unary, halt, stats)))
        if ramp_s:
            await asyncio.sleep(ramp_s / len(indices))
    watcher = loop.run_in_executor(None, stop.wait)
    done = asyncio.gather(*tasks)
    await asyncio.wait([watcher, done], return_when=asyncio.FIRST_COMPLETED)
    halt.set()
    await done
    get_lat = np.asarray(stats.pop("get_lat"), np.float32)
    rep_lat = np.asarray(stats.pop("rep_lat"), np.float32)
    first = np.asarray(stats.pop("first_lease"), np.float32)
    stats["client_cpu_s"] = time.process_time() - cpu0
    out.put((stats, get_lat, rep_lat, first))
    if not stop.is_set():
        await loop.run_in_executor(None, stop.wait)


def run_grpc(args, workers: int, window_s: float) -> dict:
    from elastic_step.master.failures import FailureReports
    from elastic_step.master.leases.coordinator import Coordinator
    from elastic_step.master.service import MasterService, serve
    from elastic_step.master.skipped import SkippedMinibatches

    ledger = _ledger(args, workers)
    coord = Coordinator(ledger, num_ps=0)
    failures = FailureReports(coord.timeline, job_failed=coord.finished.set)
    service = MasterService(
        coord,
        TOKEN,
        "bench",
        args.minibatch,
        "synthetic",
        max_workers=workers,
        failures=failures,
        skipped=SkippedMinibatches(coord.timeline),
    )
    server, port = serve(service)
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
            args=(address, g, args.minibatch, args.think_ms / 1e3, args.unary, args.ramp_s, ready, start, stop, out),
        )
        for g in groups
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)  # every client process is up (grpc imported)

    t0 = time.perf_counter()
    cpu0 = time.process_time()  # this process is the master: its gRPC server + coordinator
    start.set()  # registrations are part of the run: all at once (--ramp-s 0) or spread
    coord.finished.wait(timeout=window_s)
    elapsed = time.perf_counter() - t0
    master_cpu = time.process_time() - cpu0
    finished = coord.finished.is_set()
    with coord.lock:  # the figures at the end of the window
        committed = ledger.records_committed_total()
        exact = _committed_exactly_once(ledger)
    stop.set()
    parts = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    server.stop(None)

    keys = [k for k in parts[0][0] if k not in ("error_codes", "errors_seen")]
    counts = {k: sum(c[k] for c, *_ in parts) for k in keys}
    codes: dict[str, int] = {}
    for c, *_ in parts:
        for k, v in c["error_codes"].items():
            codes[k] = codes.get(k, 0) + v
    get_lat = np.concatenate([g for _, g, _, _ in parts])
    rep_lat = np.concatenate([r for _, _, r, _ in parts])
    first = np.concatenate([f for _, _, _, f in parts])
    return {
        "mode": "grpc",
        "workers": workers,
        "client_procs": nproc,
        "elapsed_s": elapsed,
        "finished": finished,
        "records_committed": committed,
        "exactly_once": exact and counts["tallied"] == committed,
        "clients_tallied": counts["tallied"],
        "leases": counts["leases"],
        "reports": counts["reports"],
        "waits": counts["waits"],
        "backoffs": counts["backoffs"],
        "refused": counts["refused"],
        "errors": counts["errors"],
        "error_codes": codes,
        "errors_seen": sorted({m for c, *_ in parts for m in c["errors_seen"]})[:5],
        "rpcs": counts["rpcs"],
        "master_cpu_s": master_cpu,
        "master_cpu_us_per_rpc": master_cpu / max(1, counts["rpcs"]) * 1e6,
        "client_cpu_s": counts["client_cpu_s"],
        "got_a_lease": int(first.size),
        "first_lease_max_s": float(first.max()) if first.size else float("nan"),
        "get_task_ms": _percentiles(get_lat),
        "report_ms": _percentiles(rep_lat),
        "all_ms": _percentiles(np.concatenate([get_lat, rep_lat])),
    }


def _committed_exactly_once(ledger) -> bool | None:
    """Once the ledger is done: every task committed to its end, and the committed records sum to the dataset's
    size per epoch (no record twice, none missing). None while it is not done."""
    if not ledger.done:
        return None
    return ledger.records_committed_total() == ledger.records_per_epoch * ledger.epochs


# ---------------------------------------------------------------------------- in-process baselines


def run_inprocess(args, workers: int, window_s: float, with_coordinator: bool) -> dict:
    """The same workload, round-robin over `workers` simulated workers, no gRPC."""
    from elastic_step.backends.api import InstanceId
    from elastic_step.master.leases.coordinator import Coordinator

    ledger = _ledger(args, workers)
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
        ratio = f"{rt['records_per_s'] / b['records_per_s']:.4f}" if b["records_per_s"] else "-"
    return (
        f"{label:<24}{r['elapsed_s']:>8.1f}{'*' if not r['finished'] else ' '}"
        f"{rt['leases_per_s']:>11.0f}{rt['reports_per_s']:>11.0f}{rt['records_per_s']:>12.0f}"
        f"{r['get_task_ms'][0]:>9.3f}{r['get_task_ms'][1]:>9.3f}"
        f"{r['report_ms'][0]:>9.3f}{r['report_ms'][1]:>9.3f}{ratio:>10}"
    )


def run_before(tree, argv: list[str], workers: int) -> dict:
    """The gRPC run of `workers` as the checkout `tree` (an earlier revision) has this bench and the master, with
    this invocation's other arguments `argv`."""
    from bench.common import run_cli

    with tempfile.TemporaryDirectory(prefix="bench-capacity-") as tmp:
        out = os.path.join(tmp, "figures.json")
        cmd = [sys.executable, "bench/master_capacity.py", *argv, "--workers", str(workers), "--json", out]
        proc = run_cli(cmd, root=tree)
        if proc.returncode != 0:
            raise SystemExit(f"the earlier revision's run failed:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)[0]["grpc"]


def forwarded(argv: list[str]) -> list[str]:
    """`argv` without the flags `run_before` sets itself (--workers, --json) and without --before."""
    out, skip = [], False
    for a in argv:
        if a.split("=", 1)[0] in ("--workers", "--json", "--before"):
            skip = "=" not in a
            continue
        if skip and not a.startswith("--"):
            continue
        skip = False
        out.append(a)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1000], help="simulated workers per run")
    p.add_argument("--records", type=int, default=4_000_000)
    p.add_argument(
        "--leases-per-worker", type=int, default=0, help="size the data to this many leases a worker (0: --records)"
    )
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--minibatch", type=int, default=64)
    p.add_argument("--records-per-task", type=int, default=512)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--client-procs", type=int, default=1, help="processes the simulated workers are spread over")
    p.add_argument(
        "--think-ms", type=float, default=0.0, help="simulated compute per minibatch (0: saturate the master)"
    )
    p.add_argument(
        "--unary", action="store_true", help="Register, GetTask, ReportProgress as unary calls, not on a stream"
    )
    p.add_argument("--ramp-s", type=float, default=0.0, help="registrations spread over this (0: all at once)")
    p.add_argument("--window", type=float, default=30.0, help="longest gRPC run, seconds")
    p.add_argument("--baseline-s", type=float, default=3.0, help="window of each in-process baseline")
    p.add_argument("--json", help="also write the raw figures here")
    p.add_argument("--before", metavar="REV", help="also each gRPC run as this git revision has it")
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        from bench.common import revision_tree

        tree = stack.enter_context(revision_tree(args.before)) if args.before else None
        return measure(args, tree, forwarded(sys.argv[1:] if argv is None else argv))


def measure(args, tree, argv: list[str]) -> int:
    """main's runs: per worker count, the in-process baselines, the gRPC run and, with a `tree`, its gRPC run."""

    t_start = time.perf_counter()
    print(
        f"master capacity: {args.records_per_task} records/task, minibatch {args.minibatch}, {args.epochs} epoch(s); "
        f"{os.cpu_count()} CPUs; client procs {args.client_procs}; think {args.think_ms} ms; ramp {args.ramp_s} s; "
        f"{'unary calls' if args.unary else 'a Session stream per worker'}",
        flush=True,
    )
    results = []
    for w in args.workers:
        ledger_r = run_inprocess(args, w, args.baseline_s, with_coordinator=False)
        coord_r = run_inprocess(args, w, args.baseline_s, with_coordinator=True)
        grpc_r = run_grpc(args, w, args.window)
        before_r = run_before(tree, argv, w) if tree else None
        results.append((w, ledger_r, coord_r, grpc_r, before_r))
        g = grpc_r
        print(
            f"  workers={w}: {_records(args, w):,} records, {g['elapsed_s']:.1f} s, "
            f"{g['records_committed']:,} committed (exactly once: {g['exactly_once']}), "
            f"{g['got_a_lease']} workers got a lease (last after {g['first_lease_max_s']:.1f} s); "
            f"waits {g['waits']}, come-back-afters {g['backoffs']}, refused {g['refused']}, "
            f"errors {g['errors']} {g['error_codes'] or ''} {g['errors_seen'] or ''}; {g['rpcs']:,} calls; "
            f"master CPU {g['master_cpu_s']:.1f} s = {g['master_cpu_us_per_rpc']:.0f} us/call; "
            f"clients' CPU {g['client_cpu_s']:.1f} s",
            flush=True,
        )

    hdr = (
        f"{'run':<24}{'secs':>9}{'leases/s':>11}{'reports/s':>11}{'records/s':>12}"
        f"{'get p50':>9}{'get p99':>9}{'rep p50':>9}{'rep p99':>9}{'x ledger':>10}"
    )
    print()
    print(hdr)
    print("-" * len(hdr))
    for w, ledger_r, coord_r, grpc_r, before_r in results:
        print(_row(f"ledger      W={w}", ledger_r, None))
        print(_row(f"coordinator W={w}", coord_r, ledger_r))
        print(_row(f"gRPC        W={w}", grpc_r, ledger_r))
        if before_r:
            print(_row(f"gRPC at {args.before[:8]} W={w}", before_r, ledger_r))
            ratio = _rates(grpc_r)["records_per_s"] / _rates(before_r)["records_per_s"]
            cpu = (grpc_r["master_cpu_us_per_rpc"], before_r["master_cpu_us_per_rpc"])
            print(
                f"  this revision against {args.before}: records/s x{ratio:.2f}, master CPU a call {cpu[0]:.0f} us "
                f"against {cpu[1]:.0f}"
            )
    print(
        "latencies in ms; '*' = window ended before the ledger was done; "
        "'x ledger' = records/s relative to the in-process Ledger alone"
    )
    print(f"total {time.perf_counter() - t_start:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [
                    {"workers": w, "ledger": a, "coordinator": b, "grpc": c, **({"grpc_before": d} if d else {})}
                    for w, a, b, c, d in results
                ],
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
