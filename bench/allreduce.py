"""Ring AllReduce throughput against raw loopback bandwidth, measured in the same run, and the pause
after a loss in a real `--strategy allreduce` job.

1. Raw loopback: one process sends the buffer's bytes to another over a plain TCP socket
   (sendall/recv_into, 4 MB writes): the ceiling any transport on this machine can reach.
2. Ring AllReduce: N processes (spawned, no TensorFlow), each with its Collective gRPC server and
   `Ring`, allreduce a flat float32 buffer of `--params` values `--steps` times. Reported:
   steps/s, algorithm bandwidth (buffer bytes / step time) and bus bandwidth (the bytes each member
   actually sends per step, 2(N-1)/N × buffer, / step time), and bus bandwidth / raw loopback.
   The sum is checked against numpy.
3. Pause after a loss (skip with --no-loss): a real digits job on 3 local workers, one SIGKILLed
   mid-epoch (`--chaos`); the summary's `recovery.loss_to_next_commit_s` is the time from the
   kill to the survivors' next committed step.

    .venv/bin/python bench/allreduce.py                       # 4M params, 2 and 3 members, + loss
    .venv/bin/python bench/allreduce.py --params 2000000 --members 3 --steps 10 --no-loss

Every process shares this machine's cores: on a 2-core box 3 members plus the senders' threads
compete for CPU, so the ratios are a lower bound of what separate hosts would see.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TOKEN = "bench-token"


# ---------------------------------------------------------------- raw loopback
def _sink(port_q, nbytes: int, reps: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    for _ in range(reps):
        left = nbytes
        while left:
            left -= conn.recv_into(view[:min(left, len(buf))])
        conn.sendall(b"k")
    conn.close()


def raw_loopback(nbytes: int, reps: int = 5) -> float:
    """Bytes/s of a plain TCP transfer between two processes on 127.0.0.1 (best of `reps`)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_sink, args=(q, nbytes, reps))
    p.start()
    s = socket.create_connection(("127.0.0.1", q.get(timeout=30)))
    data = memoryview(np.ones(nbytes, np.uint8))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(0, nbytes, 4 << 20):
            s.sendall(data[i:i + (4 << 20)])
        s.recv(1)
        best = min(best, time.perf_counter() - t)
    s.close()
    p.join(10)
    return nbytes / best


# ---------------------------------------------------------------- ring members
def _member(rank: int, n: int, params: int, steps: int, addr_q, peers_q, out_q) -> None:
    from elastic_step.worker import collective

    mailbox, state = collective.Mailbox(), collective.StateProvider()
    server, port = collective.serve(collective.CollectiveService(TOKEN, mailbox, state), "127.0.0.1")
    addr_q.put((rank, f"127.0.0.1:{port}"))
    members = peers_q.get(timeout=60)
    ring = collective.Ring(TOKEN, mailbox, f"worker-{rank}")
    rng = np.random.default_rng(rank)
    buf = rng.standard_normal(params).astype(np.float32)
    ring.allreduce(buf, members, 1, 0, lambda: None)      # warm-up: channels connected
    times = []
    for step in range(1, steps + 1):
        t = time.perf_counter()
        out = ring.allreduce(buf, members, 1, step, lambda: None)
        times.append(time.perf_counter() - t)
    expected = sum(np.random.default_rng(r).standard_normal(params).astype(np.float32) for r in range(n))
    out_q.put((rank, times, float(np.max(np.abs(out - expected)))))
    time.sleep(0.5)   # let the last sends land before the server goes
    ring.close()
    server.stop(0)


def ring_bench(n: int, params: int, steps: int) -> dict:
    ctx = mp.get_context("spawn")
    addr_q, out_q = ctx.Queue(), ctx.Queue()
    peers_qs = [ctx.Queue() for _ in range(n)]
    procs = [ctx.Process(target=_member, args=(r, n, params, steps, addr_q, peers_qs[r], out_q)) for r in range(n)]
    for p in procs:
        p.start()
    addrs = dict(addr_q.get(timeout=60) for _ in range(n))
    members = [(f"worker-{r}", addrs[r]) for r in range(n)]
    for q in peers_qs:
        q.put(members)
    results = [out_q.get(timeout=600) for _ in range(n)]
    for p in procs:
        p.join(10)
    # A step ends when its slowest member is done: take, per step, the max over members.
    per_step = np.max(np.array([r[1] for r in results]), axis=0)
    step_s = float(np.median(per_step))
    nbytes = params * 4
    return {"members": n, "params": params, "buffer_bytes": nbytes, "steps": steps,
            "step_s_median": round(step_s, 4), "steps_per_s": round(1 / step_s, 2),
            "algo_bytes_per_s": nbytes / step_s, "bus_bytes_per_s": 2 * (n - 1) / n * nbytes / step_s,
            "max_abs_error": max(r[2] for r in results)}


# ---------------------------------------------------------------- pause after a loss
def loss_pause() -> dict:
    from elastic_step.data.prep import prepare

    tmp = tempfile.mkdtemp(prefix="es-bench-ar-")
    r = prepare(os.path.join(ROOT, "samples", "digits", "digits.csv"), os.path.join(tmp, "data"), label="label",
                seed=0)
    epochs = 25
    kill_at = int(r.train.total_rows * epochs * 0.1)
    out = os.path.join(tmp, "out")
    proc = subprocess.run([sys.executable, "-m", "elastic_step.cli", "train", "--strategy", "allreduce",
                           "--model-def", os.path.join(ROOT, "samples", "digits", "model.py"),
                           "--train-data", r.train_uri, "--eval-data", r.eval_uri, "--output", out,
                           "--epochs", str(epochs), "--max-workers", "3", "--min-workers", "2",
                           "--minibatch-size", "32", "--records-per-task", "128", "--progress", "off",
                           "--chaos", f"kill:worker-1@{kill_at}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    s = json.load(open(os.path.join(out, "summary.json")))
    return {"loss_to_next_commit_s": s["recovery"]["loss_to_next_commit_s"],
            "join_to_first_commit_s": s["recovery"]["join_to_first_commit_s"],
            "requeue_latency_s": s["recovery"]["requeue_latency_s"],
            "aborted_steps": s["allreduce"]["aborted_steps"],
            "checksum_mismatches": s["allreduce"]["checksum_mismatches"],
            "accuracy": s["eval"].get("accuracy"), "throughput_records_per_s": s["throughput_records_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=4_000_000, help="float32 values in the buffer")
    ap.add_argument("--members", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-loss", action="store_true", help="skip the job with a SIGKILL")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    nbytes = args.params * 4
    raw = raw_loopback(nbytes)
    print(f"raw loopback TCP: {raw / 1e6:.0f} MB/s ({nbytes / 1e6:.1f} MB buffer)")
    figures = {"raw_loopback_bytes_per_s": raw, "rings": []}
    for n in args.members:
        r = ring_bench(n, args.params, args.steps)
        r["bus_over_raw"] = r["bus_bytes_per_s"] / raw
        figures["rings"].append(r)
        print(f"ring allreduce, {n} members, {args.params / 1e6:.1f}M params ({nbytes / 1e6:.1f} MB): "
              f"{r['steps_per_s']:.2f} steps/s, algorithm {r['algo_bytes_per_s'] / 1e6:.0f} MB/s, "
              f"bus {r['bus_bytes_per_s'] / 1e6:.0f} MB/s = {r['bus_over_raw']:.2f} x raw loopback "
              f"(max |error| {r['max_abs_error']:.2g})")
    if not args.no_loss:
        figures["loss"] = loss_pause()
        print("pause after a loss (3 workers, digits, one SIGKILLed): " + json.dumps(figures["loss"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
