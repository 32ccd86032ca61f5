"""Ring AllReduce bus bandwidth beside torch.distributed's gloo, TensorFlow's ring collective and raw
loopback TCP, all measured in the same run; and the pause after a loss in a real `--strategy allreduce` job.

For each buffer size (`--params` float32 values) and member count (`--members`), `--repeats` rounds,
each running every contender in turn for `--steps` timed steps (after one warm-up step):
  * ours: N spawned processes, each with its Collective gRPC server and `Ring`; on one host, as here,
    each member's output is a shared-memory lane that its right neighbour reads in place, the whole
    ring shares one result reduced in place (ring_result.py), and the TCP connections carry headers;
  * ours-tcp: the same with payloads over TCP too (`Ring(shared_memory=False)`), as between hosts or
    pods: what a job spread over nodes gets;
  * gloo: N processes, `torch.distributed` with backend "gloo", initialised over a TCP store on
    127.0.0.1 (GLOO_SOCKET_IFNAME=lo), one intra-op thread per process (what torchrun sets), the
    buffer copied into a tensor kept from step to step, then `dist.all_reduce` of it in place;
  * TF: N processes, `tf.distribute.MultiWorkerMirroredStrategy` with CommunicationImplementation.RING
    (TF_CONFIG on 127.0.0.1 ports), `strategy.extended.reduce_to(SUM)` of the buffer in a tf.function;
  * raw loopback: one process sends the buffer's bytes to another over a plain TCP socket
    (sendall/recv_into, 4 MB writes): the ceiling any transport on this machine can reach;
  * raw both ways: two processes send the buffer's bytes to each other at once (per direction), as a
    ring member sends to one neighbour while it receives from the other. With 2 members each sends and
    receives the whole buffer per step, so this, not one-way loopback, bounds a ring's bus bandwidth
    on a machine whose cores do the kernel's copies for both directions (on 2 cores, about half of
    one-way); with 3 members on 2 cores, lower still.
Each contender's processes start once per member count and stay up for every size and round. A step's
time is the slowest member's; a round's figure is the median over its steps, and raw loopback's round
is measured alike: one warm-up transfer, then the median of as many transfers as steps. Bus bandwidth is
the bytes each member sends per step, 2(N-1)/N x buffer, over the step time (raw: buffer / transfer
time, per direction for both ways). Printed: min/median/max over the rounds, and the ratios best against
best. Every result is checked against numpy's sum (max |error|).

torch is a bench-only extra: `.venv/bin/pip install -c constraints.txt -e ".[bench]"`. PyPI's Linux
torch wheel links CUDA libraries, so this pulls the nvidia-* wheels (~2.8 GB) although gloo runs on the
CPU. Without torch the gloo column says so and the rest still runs.

    .venv/bin/python bench/allreduce.py                              # 1M 4M 16M, 2 and 3 members, + loss
    .venv/bin/python bench/allreduce.py --params 4000000 --members 3 --repeats 5 --no-loss

Every process shares this machine's cores: on a 2-core box 3 members plus their threads compete for
CPU, so the figures are a lower bound of what separate hosts would see, for every contender alike.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import run_cli, summary, train_command  # noqa: E402

TOKEN = "bench-token"
CONTENDERS = ("ours", "ours-tcp", "gloo", "tf")


# ---------------------------------------------------------------- raw loopback
def _round_seconds(transfer, steps: int) -> float:
    """A transfer's seconds, measured as a contender's round is: one warm-up, then the median of `steps`."""
    times = []
    for _ in range(1 + steps):
        t = time.perf_counter()
        transfer()
        times.append(time.perf_counter() - t)
    return float(np.median(times[1:]))


def _sink(port_q, nbytes: int, transfers: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    for _ in range(transfers):
        left = nbytes
        while left:
            left -= conn.recv_into(view[: min(left, len(buf))])
        conn.sendall(b"k")
    conn.close()


def raw_loopback(nbytes: int, steps: int) -> float:
    """Bytes/s of a plain TCP transfer between two processes on 127.0.0.1, measured as a contender's
    round is (`_round_seconds`)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_sink, args=(q, nbytes, 1 + steps))
    p.start()
    s = socket.create_connection(("127.0.0.1", q.get(timeout=30)))
    data = memoryview(np.ones(nbytes, np.uint8))

    def transfer() -> None:
        for i in range(0, nbytes, 4 << 20):
            s.sendall(data[i : i + (4 << 20)])
        s.recv(1)

    seconds = _round_seconds(transfer, steps)
    s.close()
    p.join(10)
    return nbytes / seconds


def _both_ways(conn: socket.socket, nbytes: int) -> None:
    """Send `nbytes` on `conn` from a thread while receiving as many."""
    import threading

    data = memoryview(np.ones(nbytes, np.uint8))
    sink = memoryview(bytearray(4 << 20))
    sender = threading.Thread(target=lambda: [conn.sendall(data[i : i + (4 << 20)]) for i in range(0, nbytes, 4 << 20)])
    sender.start()
    left = nbytes
    while left:
        left -= conn.recv_into(sink[: min(left, len(sink))])
    sender.join()


def _duplex_peer(port: int, nbytes: int, transfers: int) -> None:
    conn = socket.create_connection(("127.0.0.1", port))
    for _ in range(transfers):
        _both_ways(conn, nbytes)
    conn.close()


def raw_duplex(nbytes: int, steps: int) -> float:
    """Bytes/s each way of two processes sending `nbytes` to each other at once over 127.0.0.1 (as
    `raw_loopback`, the median of `steps` after a warm-up): what a ring member does, sending to one
    neighbour while receiving from the other."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    p = mp.get_context("spawn").Process(target=_duplex_peer, args=(srv.getsockname()[1], nbytes, 1 + steps))
    p.start()
    conn, _ = srv.accept()
    seconds = _round_seconds(lambda: _both_ways(conn, nbytes), steps)
    conn.close()
    srv.close()
    p.join(10)
    return nbytes / seconds


# ---------------------------------------------------------------- the contenders' members
def free_ports(k: int) -> list[int]:
    socks = [socket.socket() for _ in range(k)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _ours(rank: int, n: int, rendezvous, shared_memory: bool = True):
    from elastic_step.worker.allreduce import collective

    name = f"worker-{rank}"
    ring = collective.Ring(TOKEN, name, "127.0.0.1", shared_memory)
    server, port = collective.serve(
        collective.CollectiveService(TOKEN, collective.StateProvider(), ring.port), "127.0.0.1"
    )
    addr_q, peers_q = rendezvous
    addr_q.put((rank, f"127.0.0.1:{port}"))
    members = peers_q.get(timeout=120)
    step = iter(range(1, 1 << 62))

    def allreduce(buf: np.ndarray) -> np.ndarray:
        return ring.allreduce(buf, members, 1, next(step), lambda: None)

    def close() -> None:
        ring.close()
        server.stop(0)

    return allreduce, close


def _gloo(rank: int, n: int, rendezvous):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1 per process: N processes share the cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{rendezvous}", rank=rank, world_size=n)

    held = {}

    def allreduce(buf: np.ndarray) -> np.ndarray:
        # As ours: the caller's buffer stays as it was, so its values go into a tensor kept from step to
        # step (as ours keeps its lanes), and all_reduce works in place there.
        t = held.get(buf.size)
        if t is None:
            t = held[buf.size] = torch.empty(buf.size, dtype=torch.float32)
        np.copyto(t.numpy(), buf)
        dist.all_reduce(t)
        return t.numpy()

    return allreduce, dist.destroy_process_group


def _tf(rank: int, n: int, rendezvous):
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": [f"127.0.0.1:{p}" for p in rendezvous]}, "task": {"type": "worker", "index": rank}}
    )
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)

    # The strategy's cross-worker reduction (its CollectiveAllReduce, RING): each worker holds one replica.
    @tf.function
    def step(x):
        return strategy.extended.reduce_to(
            tf.distribute.ReduceOp.SUM, x, destinations=strategy.extended.worker_devices[0]
        )

    def allreduce(buf: np.ndarray) -> np.ndarray:
        return step(tf.constant(buf)).numpy()

    return allreduce, lambda: None


SETUP = {"ours": _ours, "ours-tcp": functools.partial(_ours, shared_memory=False), "gloo": _gloo, "tf": _tf}


def _member(contender: str, rank: int, n: int, rendezvous, cmd_q, out_q) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        allreduce, close = SETUP[contender](rank, n, rendezvous)
    except Exception as e:  # noqa: BLE001 - reported in the table (e.g. torch not installed)
        out_q.put((rank, f"{type(e).__name__}: {e}"))
        return
    out_q.put((rank, "ready"))
    while (cmd := cmd_q.get()) is not None:
        params, steps = cmd
        buf = np.random.default_rng(rank).standard_normal(params).astype(np.float32)
        try:
            allreduce(buf)  # warm-up: connections made, graphs traced
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                out = allreduce(buf)
                times.append(time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001 - reported in the table
            out_q.put((rank, f"{type(e).__name__}: {e}"))
            return
        expected = sum(np.random.default_rng(r).standard_normal(params).astype(np.float32) for r in range(n))
        out_q.put((rank, times, float(np.max(np.abs(out - expected)))))
    close()


class Group:
    """One contender's N member processes, up for every size and round."""

    def __init__(self, contender: str, n: int):
        ctx = mp.get_context("spawn")
        self.contender, self.n, self.error = contender, n, None
        self.out_q, self.cmd_qs = ctx.Queue(), [ctx.Queue() for _ in range(n)]
        if contender.startswith("ours"):
            addr_q, peers_qs = ctx.Queue(), [ctx.Queue() for _ in range(n)]
            rendezvous = [(addr_q, q) for q in peers_qs]
        elif contender == "gloo":
            rendezvous = free_ports(1) * n
        else:
            rendezvous = [free_ports(n)] * n
        self.procs = [
            ctx.Process(target=_member, args=(contender, r, n, rendezvous[r], self.cmd_qs[r], self.out_q))
            for r in range(n)
        ]
        for p in self.procs:
            p.start()
        if contender.startswith("ours"):
            addrs = dict(addr_q.get(timeout=120) for _ in range(n))
            for q in peers_qs:
                q.put([(f"worker-{r}", addrs[r]) for r in range(n)])
        answers = [self.out_q.get(timeout=300)[1] for _ in range(n)]
        self.error = next((a for a in answers if a != "ready"), None)

    def run(self, params: int, steps: int) -> tuple[float, float] | None:
        """(median step time, max |error|) of `steps` allreduces of `params` values; None if it failed."""
        for q in self.cmd_qs:
            q.put((params, steps))
        results = [self.out_q.get(timeout=1800) for _ in range(self.n)]
        failed = [r[1] for r in results if isinstance(r[1], str)]
        if failed:
            self.error = failed[0][:300]
            return None
        per_step = np.max(np.array([r[1] for r in results]), axis=0)
        return float(np.median(per_step)), max(r[2] for r in results)

    def close(self) -> None:
        for q in self.cmd_qs:
            q.put(None)
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def spread(xs: list[float]) -> dict:
    return {"min": min(xs), "median": float(np.median(xs)), "max": max(xs)}


def compare(sizes: list[int], members: list[int], repeats: int, steps: int, contenders=CONTENDERS) -> list[dict]:
    rows = []
    raw: dict[int, list[float]] = {p: [] for p in sizes}
    duplex: dict[int, list[float]] = {p: [] for p in sizes}
    for n in members:
        groups = {c: Group(c, n) for c in contenders}
        try:
            for params in sizes:
                nbytes = 4 * params
                bus = {c: [] for c in contenders}
                error = dict.fromkeys(contenders, 0.0)
                for _ in range(repeats):
                    if len(raw[params]) < repeats:
                        raw[params].append(raw_loopback(nbytes, steps))
                        duplex[params].append(raw_duplex(nbytes, steps))
                    for c, g in groups.items():
                        if g.error is None and (result := g.run(params, steps)) is not None:
                            bus[c].append(2 * (n - 1) / n * nbytes / result[0])
                            error[c] = max(error[c], result[1])
                row = {
                    "members": n,
                    "params": params,
                    "buffer_bytes": nbytes,
                    "steps": steps,
                    "repeats": repeats,
                    "raw_bytes_per_s": spread(raw[params]),
                    "duplex_bytes_per_s": spread(duplex[params]),
                }
                for c, g in groups.items():
                    row[c] = (
                        {"error": g.error}
                        if g.error
                        else {"bus_bytes_per_s": spread(bus[c]), "max_abs_error": error[c]}
                    )
                best = {c: row[c]["bus_bytes_per_s"]["max"] for c in contenders if "bus_bytes_per_s" in row[c]}
                peers = {
                    **{c: b for c, b in best.items() if not c.startswith("ours")},
                    "raw": row["raw_bytes_per_s"]["max"],
                    "duplex": row["duplex_bytes_per_s"]["max"],
                }
                row["ratios_best"] = {
                    f"{ours}/{c}": best[ours] / b
                    for ours in ("ours", "ours-tcp")
                    if ours in best
                    for c, b in peers.items()
                }
                rows.append(row)
                print_row(row)
        finally:
            for g in groups.values():
                g.close()
    return rows


def _mbs(s: dict) -> str:
    return f"{s['min'] / 1e6:5.0f} {s['median'] / 1e6:5.0f} {s['max'] / 1e6:5.0f}"


HEADER = (
    f"{'N':>2} {'values':>6} {'MB':>5} | {'ours bus MB/s':^17} | {'ours-tcp bus MB/s':^17} | "
    f"{'gloo bus MB/s':^17} | {'TF ring bus MB/s':^17} | {'raw loopback MB/s':^17} | "
    f"{'raw both ways MB/s':^17} | ours/gloo ours/TF ours/raw ours/both tcp/gloo tcp/both | "
    f"max|err| ours/tcp/gloo/TF\n"
    f"{'':>16} | {'min   med   max':^17} | {'min   med   max':^17} | {'min   med   max':^17} | "
    f"{'min   med   max':^17} | {'min   med   max':^17} | {'min   med   max':^17} | {'(best against best)':^54} |"
)


def print_row(row: dict) -> None:
    cells = [
        _mbs(row[c]["bus_bytes_per_s"]) if "bus_bytes_per_s" in row.get(c, {}) else f"{'n/a':^17}" for c in CONTENDERS
    ]
    r = row["ratios_best"]
    ratio = " ".join(
        f"{r[k]:>{w}.2f}" if k in r else f"{'n/a':>{w}}"
        for k, w in (
            ("ours/gloo", 9),
            ("ours/tf", 7),
            ("ours/raw", 8),
            ("ours/duplex", 9),
            ("ours-tcp/gloo", 8),
            ("ours-tcp/duplex", 8),
        )
    )
    errs = "/".join(f"{row[c]['max_abs_error']:.1g}" if "max_abs_error" in row.get(c, {}) else "-" for c in CONTENDERS)
    print(
        f"{row['members']:>2} {row['params'] / 1e6:>5.0f}M {row['buffer_bytes'] / 1e6:>5.1f} | "
        f"{' | '.join(cells)} | {_mbs(row['raw_bytes_per_s'])} | {_mbs(row['duplex_bytes_per_s'])} | {ratio}  | "
        f"{errs}",
        flush=True,
    )
    for c in CONTENDERS:
        if "error" in row.get(c, {}):
            print(f"   {c}: could not run: {row[c]['error']}", flush=True)


# ---------------------------------------------------------------- pause after a loss
def loss_pause() -> dict:
    from elastic_step.data.prep import prepare

    tmp = tempfile.mkdtemp(prefix="es-bench-ar-")
    r = prepare(os.path.join(ROOT, "samples", "digits", "digits.csv"), os.path.join(tmp, "data"), label="label", seed=0)
    epochs = 25
    kill_at = int(r.train.total_rows * epochs * 0.1)
    out = os.path.join(tmp, "out")
    proc = run_cli(
        train_command(
            "--chaos",
            f"kill:worker-1@{kill_at}",
            strategy="allreduce",
            model_def=os.path.join(ROOT, "samples", "digits", "model.py"),
            train_data=r.train_uri,
            eval_data=r.eval_uri,
            output=out,
            epochs=epochs,
            max_workers=3,
            min_workers=2,
            minibatch_size=32,
            records_per_task=128,
        ),
        timeout=600,
    )
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    s = summary(out)
    return {
        "loss_to_next_commit_s": s["recovery"]["loss_to_next_commit_s"],
        "join_to_first_commit_s": s["recovery"]["join_to_first_commit_s"],
        "requeue_latency_s": s["recovery"]["requeue_latency_s"],
        "aborted_steps": s["allreduce"]["aborted_steps"],
        "checksum_mismatches": s["allreduce"]["checksum_mismatches"],
        "accuracy": s["eval"].get("accuracy"),
        "throughput_records_per_s": s["throughput_records_per_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--params",
        type=int,
        nargs="+",
        default=[1_000_000, 4_000_000, 16_000_000],
        help="float32 values in the buffer (one comparison each)",
    )
    ap.add_argument("--members", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--repeats", type=int, default=3, help="rounds per size: the spread is over these")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per contender and round")
    ap.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    ap.add_argument("--no-loss", action="store_true", help="skip the job with a SIGKILL")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    print(HEADER, flush=True)
    figures = {"comparisons": compare(args.params, args.members, args.repeats, args.steps, args.contenders)}
    if not args.no_loss:
        figures["loss"] = loss_pause()
        print("pause after a loss (3 workers, digits, one SIGKILLed): " + json.dumps(figures["loss"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
