"""ElasticDL's two-job experiment on the real kube-scheduler: gang-style vs elastic workers.

    .venv/bin/python bench/two_jobs.py                    # 4 slots, two jobs of 3 workers; ~2.5 min here
    .venv/bin/python bench/two_jobs.py --slots 6 --workers 4 --epochs 20 --json /tmp/two_jobs.json

A real control plane (tests.infra.kube.harness: kube-apiserver, kube-scheduler, kube-controller-manager, one
process-kubelet node) with S worker *slots* (the node has S cpus; a worker requests 1 cpu, a PS
none). Two jobs each want W workers, a little more than half of the cluster (default S=4, W=3).
Job A is submitted first; job B once A's workers run. Each master is the real
`elastic-step train --backend kubernetes`, outside the cluster, with the shipped Role's rights
only (a service-account token); workers and PS are pods.

* gang-style: min_workers == max_workers == W. A job trains only once all W workers are
  registered, so B's one scheduled worker holds a slot idle while A runs, and B starts when A ends.
* elastic: min_workers 1, max W. B trains at once on the free slot and grows to W when A's
  workers go (its pending pods are scheduled by kube-scheduler as slots free).

The model is the digits MLP with a simulated accelerator (bench/models/slow_digits.py: in
a worker pod each minibatch takes at least --step-ms more), so a slot behaves like a device and
this small shared machine's CPUs are not what is measured.

Printed per scenario: makespan (A's submission to the last master's exit), each job's wait
(submission to first training step) and run time, slot utilization = training worker-seconds
(registered workers while the job trains, from each summary's timeline) / (S x makespan), and the
allocation (worker pods Running, sampled) / (S x makespan); then the gang/elastic makespan ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(ROOT))  # tests.infra.kube.harness and bench.*, when run as `python bench/two_jobs.py`
from bench.kube_job import MINIBATCH, PodSampler, master_namespace, slow_digits  # noqa: E402
from bench.kube_job import Master as KubeJob  # noqa: E402


# ---------------------------------------------------------------- the experiment
class Master(KubeJob):
    """A job of this experiment: W workers at most, of which `min_workers` to train."""

    def __init__(self, name: str, args, data: pathlib.Path, out: pathlib.Path, env: dict, min_workers: int):
        super().__init__(name, args, data / "train", out, env, min_workers, args.workers)

    def training_worker_seconds(self) -> float:
        """Registered workers integrated over the job's training (its first to its last commit)."""
        s = self.summary
        start = next(e["t"] for e in s["events"] if e["kind"] == "training_started")
        end = max(e["t"] for e in s["events"] if e["kind"] == "epoch_end")
        samples = [(x["t"], x["alive"]) for x in s["workers_alive"]]
        total, alive, t_prev = 0.0, 0, start
        for t, n in samples:
            if t > start:
                total += alive * (min(t, end) - t_prev)
                t_prev = min(t, end)
            alive = n
            if t >= end:
                break
        return total + alive * max(0.0, end - t_prev)


def scenario(mode: str, args, cp, core, data: pathlib.Path, work: pathlib.Path, env: dict) -> dict:
    min_workers = args.workers if mode == "gang" else 1
    sampler = PodSampler(core, "bench", "elastic-step/role=worker", interval=0.25)
    a = Master(f"{mode}-a", args, data, work / f"{mode}-a", env, min_workers)
    # B is submitted once A's workers all run, so A is the one that got its W slots.
    deadline = time.time() + 300
    while True:
        pods = core.list_namespaced_pod("bench", label_selector=f"elastic-step/job={mode}-a,elastic-step/role=worker")
        if sum(p.status.phase == "Running" for p in pods.items) >= args.workers:
            break
        if a.proc.poll() is not None or time.time() > deadline:
            a.wait(1)
            raise SystemExit(f"job {mode}-a never ran its {args.workers} workers")
        time.sleep(0.2)
    b = Master(f"{mode}-b", args, data, work / f"{mode}-b", env, min_workers)
    end = max(a.wait(args.budget), b.wait(args.budget))
    sampler.stopped.set()
    makespan = end - a.submitted
    busy = a.training_worker_seconds() + b.training_worker_seconds()
    allocated = sampler.integral(a.submitted, end, 2)  # worker pods Running
    out = {
        "mode": mode,
        "min_workers": min_workers,
        "max_workers": args.workers,
        "slots": args.slots,
        "makespan_s": round(makespan, 1),
        "utilization": round(busy / (args.slots * makespan), 3),
        "allocation": round(allocated / (args.slots * makespan), 3),
        "jobs": {},
    }
    for m in (a, b):
        s = m.summary
        out["jobs"][m.name] = {
            "wait_s": round((m.trained_at or m.ended) - m.submitted, 1),
            "run_s": round(m.ended - m.submitted, 1),
            "training_worker_s": round(m.training_worker_seconds(), 1),
            "max_workers_alive": s["workers"]["max_alive"],
            "records": s["ledger"]["records_committed"],
            "exact": all(e["lost"] == 0 and e["double_applied"] == 0 for e in s["ledger"]["epochs"]),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=4, help="worker slots (cpus of the node; a worker requests 1)")
    p.add_argument("--workers", type=int, default=3, help="workers each job wants (default: a bit more than half)")
    p.add_argument("--epochs", type=int, default=25, help="epochs of digits (1437 records) per job")
    p.add_argument("--records-per-task", type=int, default=256)
    p.add_argument("--budget", type=float, default=600, help="seconds a job may take before the bench gives up")
    p.add_argument(
        "--step-ms", type=float, default=50, help="simulated device time per minibatch of 32 in a worker pod"
    )
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    os.environ[slow_digits.STEP_MS_ENV] = str(args.step_ms)  # before the control plane starts its kubelet
    if not args.slots / 2 < args.workers <= args.slots:
        raise SystemExit("--workers must be more than half of --slots (and fit in them)")
    sys.path.insert(0, str(ROOT))
    from kubernetes import client

    from elastic_step.data.prep import prepare
    from tests.infra.kube.harness import ControlPlane

    t_all = time.time()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-two-jobs-") as tmp, ControlPlane() as cp:
        work = pathlib.Path(tmp)
        prepare(str(ROOT / "samples" / "digits" / "digits.csv"), str(work / "data"), label="label", seed=0)
        cp.add_node("slots", cpu=str(args.slots), memory="32Gi", pods=50)
        env = master_namespace(cp, "bench")
        core = client.CoreV1Api(cp.api_client())
        for mode in ("gang", "elastic"):
            r = scenario(mode, args, cp, core, work / "data", work, env)
            results.append(r)
            print(
                f"{mode:8s} makespan {r['makespan_s']:6.1f}s  utilization {r['utilization'] * 100:5.1f}%  "
                f"allocation {r['allocation'] * 100:5.1f}%  "
                + "  ".join(
                    f"{n}: wait {j['wait_s']}s run {j['run_s']}s max {j['max_workers_alive']} workers"
                    f"{'' if j['exact'] else ' LEDGER NOT EXACT'}"
                    for n, j in r["jobs"].items()
                ),
                flush=True,
            )
    gang, elastic = results
    ratio = gang["makespan_s"] / elastic["makespan_s"]
    print(
        f"\n{args.slots} slots, two jobs of {args.workers} workers x {args.epochs} epochs of digits, "
        f"{args.step_ms:.0f} ms simulated step per minibatch of {MINIBATCH}"
    )
    print(f"{'':10s}{'makespan':>10s}{'utilization':>13s}{'allocation':>12s}")
    for r in results:
        print(f"{r['mode']:10s}{r['makespan_s']:9.1f}s{r['utilization'] * 100:12.1f}%{r['allocation'] * 100:11.1f}%")
    print(
        f"makespan gang / elastic = {ratio:.2f}; utilization elastic / gang = "
        f"{elastic['utilization'] / gang['utilization']:.2f}  (bench {time.time() - t_all:.0f}s)"
    )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"results": results, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
