"""Gang scheduling (real Coscheduling) against elastic workers, and an online service co-located with training.

    .venv/bin/python bench/gang.py                          # 8 slots, two jobs of 5 workers; ~30 min a run
    .venv/bin/python bench/gang.py --modes elastic,elastic-all --json /tmp/gang.json   # ~37 min
    .venv/bin/python bench/gang.py --rows 450000 --modes elastic-all --scenarios two_jobs --runs 3
                                                            # the README's figures: jobs of ~400 s; ~33 min a run
    .venv/bin/python bench/gang.py --rows 120000            # jobs of ~200 s: start-up is then 15-20 % of one
    .venv/bin/python bench/gang.py --scenarios colocation   # only the service + training case

A real control plane (tests.infra.kube.harness: kube-apiserver, kube-scheduler, kube-controller-manager, one
process-kubelet node with S cpus = S worker *slots*; a worker requests 1 cpu, a PS none), plus the
Coscheduling scheduler of sigs.k8s.io/scheduler-plugins (tests.infra.kube.harness.coscheduling, built by
scripts/build-scheduler-plugins) running as a second scheduler. Each job's master is the real
`elastic-step train --backend kubernetes` outside the cluster with the shipped Role's rights only.
The model is the digits MLP with a simulated accelerator (bench/models/slow_digits.py: --step-ms per
minibatch of 32 in a worker pod), on the digits train split repeated to --rows records.

two_jobs: two jobs each want W workers, a bit more than half of S; B is submitted once A's W
workers run.
  * gang: min = max = W, the workers in a PodGroup (minMember W) and scheduled by the Coscheduling
    scheduler (`schedulerName`, ELASTIC_STEP_POD_SPEC; the group label, ELASTIC_STEP_POD_LABELS):
    all of a job's workers are placed at once or none, so B waits whole until A's workers are gone.
  * elastic: min 1, max W (--elastic-max), the default kube-scheduler: B trains at once on the S-W
    free slots and grows as A's workers go.
  Figures: makespan (A's submission to the last master's exit); when each job trains its first
  step (from A's submission); utilization from work done = records trained by both jobs /
  (records/s per slot x S x makespan), where records/s per slot is gang A's steady rate (first to
  last commit) divided by W: a job measured alone on the cluster; also the allocation (worker pods
  Running / slot-seconds). Then the elastic/gang makespan ratio.
  With max W, the best elastic makespan is (3W-S)/(2W) of gang's and its utilization 2W^2/(S(3W-S))
  (B ends alone on W of the S slots); both are printed as the ideal.
  * elastic-all (--modes elastic,elastic-all): min 1, max S. A takes the whole cluster, and B (whose
    workers never preempt) waits for A's workers to go, then takes it all in turn.

colocation: one elastic job (min 1, max S) and an "online service" Deployment whose pods (1 cpu each)
have a high PriorityClass; its replicas follow --service-schedule (seconds after the job's first
step: replicas). The real kube-scheduler preempts workers for the service's pods, the master
re-leases their work and relaunches them, and they wait Pending until the service scales down.
  Figures: each service pod's time to be bound to the node and to run (from its creation), and how
  much of the capacity the service leaves the job used: records trained over the job's training /
  records/s per slot, against the slot-seconds the service left free (S minus the service's bound
  pods, integrated).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.infra.kube.harness and bench.*, when run as `python bench/gang.py`
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from bench.common import digits_prepared  # noqa: E402
from bench.kube_job import MINIBATCH, Master, PodSampler, master_namespace, slow_digits  # noqa: E402

NS = "bench"
SERVICE = "online"
SERVICE_PRIORITY = "online-service"


# ---------------------------------------------------------------- data
def make_data(rows: int, out: pathlib.Path) -> pathlib.Path:
    """The digits train split repeated to `rows` records, shuffled, as one prepared train split."""
    return digits_prepared(rows, out) / "train"


# ---------------------------------------------------------------- one job
# ---------------------------------------------------------------- two jobs
def two_jobs(mode: str, args, core, custom, data, work, env: dict) -> dict:
    W = args.workers
    min_w, max_w = {"gang": (W, W), "elastic": (1, args.elastic_max or W), "elastic-all": (1, args.slots)}[mode]
    sampler = PodSampler(core, NS, "elastic-step/role=worker")
    t_start = time.time()

    def submit(job: str) -> Master:
        job_env = dict(env)
        if mode == "gang":
            from tests.infra.kube.harness.coscheduling import POD_GROUP_LABEL, PODGROUPS, pod_group

            custom.create_namespaced_custom_object(*PODGROUPS, NS, "podgroups", pod_group(job, W))
            job_env["ELASTIC_STEP_POD_SPEC"] = json.dumps({"schedulerName": args.gang_scheduler})
            job_env["ELASTIC_STEP_POD_LABELS"] = json.dumps({"worker": {POD_GROUP_LABEL: job}})
        return Master(job, args, data, work / job, job_env, min_w, max_w)

    a = submit(f"{mode}-a")
    deadline = time.time() + 300
    while True:  # B is submitted once A's workers all run, so A is the one that got its W slots
        pods = core.list_namespaced_pod(NS, label_selector=f"elastic-step/job={mode}-a,elastic-step/role=worker")
        if sum(p.status.phase == "Running" for p in pods.items) >= W:
            break
        if a.proc.poll() is not None or time.time() > deadline:
            a.wait(1)
            raise SystemExit(f"job {mode}-a never ran its {W} workers")
        time.sleep(0.2)
    b = submit(f"{mode}-b")
    end = max(a.wait(args.budget), b.wait(args.budget))
    sampler.stopped.set()
    makespan = end - t_start
    out = {
        "mode": mode,
        "min_workers": min_w,
        "max_workers": max_w,
        "slots": args.slots,
        "makespan_s": round(makespan, 1),
        "records": a.records + b.records,
        "allocation": round(sampler.integral(t_start, end, 2) / (args.slots * makespan), 3),
        "jobs": {},
    }
    for m in (a, b):
        s = m.summary
        out["jobs"][m.name] = {
            "submitted_s": round(m.submitted - t_start, 1),
            "first_step_s": round((m.trained_at or m.ended) - t_start, 1),
            "end_s": round(m.ended - t_start, 1),
            "startup_s": round((m.trained_at or m.ended) - m.submitted, 1),
            "first_worker_bound_s": min(
                (
                    round(p["bound"] - t_start, 1)
                    for n, p in sampler.pods.items()
                    if n.startswith(f"{m.name}-worker-") and p["bound"]
                ),
                default=None,
            ),
            "max_workers_alive": s["workers"]["max_alive"],
            "records": m.records,
            "rate": s["throughput_records_per_s"],
            "exact": m.exact(),
        }
    if mode == "gang":
        out["rate_per_slot"] = round(a.summary["throughput_records_per_s"] / W, 1)  # A alone on W slots
    return out


def with_utilization(r: dict, rate_per_slot: float) -> dict:
    r["utilization"] = round(r["records"] / (rate_per_slot * r["slots"] * r["makespan_s"]), 3)
    return r


# ---------------------------------------------------------------- co-location
def colocation(args, core, apps, data, work, env: dict, rate_per_slot: float | None) -> dict:
    S = args.slots
    schedule = [(float(t), int(n)) for t, n in (x.split(":") for x in args.service_schedule.split(","))]
    apps.create_namespaced_deployment(
        NS,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": SERVICE},
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": {"app": SERVICE}},
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "100%", "maxUnavailable": 0}},
                "template": {
                    "metadata": {"labels": {"app": SERVICE}},
                    "spec": {
                        "priorityClassName": SERVICE_PRIORITY,
                        "terminationGracePeriodSeconds": 2,
                        "automountServiceAccountToken": False,
                        "containers": [
                            {
                                "name": "serve",
                                "image": "busybox",
                                "command": ["sleep", "100000"],
                                "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "1"}},
                            }
                        ],
                    },
                },
            },
        },
    )
    service = PodSampler(core, NS, f"app={SERVICE}")
    workers = PodSampler(core, NS, "elastic-step/role=worker")
    t_start = time.time()
    job = Master("colo", args, data, work / "colo", env, 1, S, args.colocation_epochs)
    while job.trained_at is None:
        if job.proc.poll() is not None:
            job.wait(1)
        time.sleep(0.1)
    scaled: list[tuple[float, int]] = []
    for at, replicas in schedule:
        delay = job.trained_at + at - time.time()
        if delay > 0 and job.proc.poll() is None:
            time.sleep(delay)
        if job.proc.poll() is not None:
            break
        apps.patch_namespaced_deployment_scale(SERVICE, NS, {"spec": {"replicas": replicas}})
        scaled.append((time.time() - t_start, replicas))
    job.wait(args.budget)
    service.stopped.set()
    workers.stopped.set()
    apps.patch_namespaced_deployment_scale(SERVICE, NS, {"spec": {"replicas": 0}})
    t0, t1 = job.trained_at, job.ended
    if rate_per_slot is None:  # the job alone on all S slots, before the service's first pod
        first = job.trained_at + schedule[0][0]
        alone_from = next((t for t, _, n in workers.samples if n >= S and t >= t0), first)
        rate_per_slot = job.records_between(alone_from + 2, first) / (first - alone_from - 2) / S
    leftover = S * (t1 - t0) - service.integral(t0, t1, 1)
    used = job.records_between(t0, t1) / rate_per_slot
    pods = sorted(service.pods.values(), key=lambda p: p["seen"])
    bind = [p["bound"] - p["seen"] for p in pods if p["bound"]]
    run = [p["running"] - p["seen"] for p in pods if p["running"]]
    if not bind:
        raise SystemExit(
            f"colocation: no service pod was bound ({len(pods)} created; the service scaled at "
            f"{[(round(t, 1), n) for t, n in scaled]}): the job ended at {job.ended - t_start:.0f} s, "
            "before the service's schedule. Give it more --rows or --colocation-epochs."
        )
    return {
        "mode": "colocation",
        "slots": S,
        "schedule": schedule,
        "scaled_at_s": [(round(t, 1), n) for t, n in scaled],
        "job": {
            "first_step_s": round(job.trained_at - t_start, 1),
            "end_s": round(job.ended - t_start, 1),
            "records": job.records,
            "exact": job.exact(),
            "workers_lost": job.summary["workers"].get("lost"),
            "max_workers_alive": job.summary["workers"]["max_alive"],
        },
        "rate_per_slot": round(rate_per_slot, 1),
        "service_pods": len(pods),
        "service_unbound": len(pods) - len(bind),
        "bind_s": {"min": round(min(bind), 2), "median": round(statistics.median(bind), 2), "max": round(max(bind), 2)}
        if bind
        else None,
        "running_s": {"min": round(min(run), 2), "median": round(statistics.median(run), 2), "max": round(max(run), 2)}
        if run
        else None,
        "pods": [
            {
                "created_s": round(p["seen"] - t_start, 1),
                "bound_after_s": round(p["bound"] - p["seen"], 2) if p["bound"] else None,
                "running_after_s": round(p["running"] - p["seen"], 2) if p["running"] else None,
            }
            for p in pods
        ],
        "leftover_slot_s": round(leftover, 1),
        "used_slot_s": round(used, 1),
        "leftover_used": round(used / leftover, 3) if leftover > 0 else None,
        "worker_pods_running_of_leftover": round(workers.integral(t0, t1, 2) / leftover, 3) if leftover else None,
    }


# ---------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=8, help="worker slots (cpus of the node; a worker requests 1)")
    p.add_argument("--workers", type=int, default=5, help="workers each job wants (a bit more than half)")
    p.add_argument("--elastic-max", type=int, default=None, help="elastic jobs' max workers (default --workers)")
    p.add_argument(
        "--rows",
        type=int,
        default=300_000,
        help="records of the train split (digits repeated); 300 000 x 2 epochs: jobs of ~400 s alone",
    )
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--records-per-task", type=int, default=256)
    p.add_argument(
        "--step-ms", type=float, default=100, help="simulated device time per minibatch of 32 in a worker pod"
    )
    p.add_argument("--runs", type=int, default=1)
    p.add_argument(
        "--modes",
        default="elastic",
        help="what gang is compared with: elastic (min 1, max --workers), elastic-all (min 1, max --slots)",
    )
    p.add_argument("--scenarios", default="two_jobs,colocation")
    p.add_argument(
        "--service-schedule",
        default="30:4,60:7,90:2,120:0",
        help="seconds after the co-located job's first step : service replicas, comma-separated",
    )
    p.add_argument("--colocation-epochs", type=int, default=1, help="epochs of the co-located job")
    p.add_argument("--budget", type=float, default=1200, help="seconds a job may take before the bench gives up")
    p.add_argument("--gang-scheduler", default="gang-scheduler", help="schedulerName of the Coscheduling scheduler")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    os.environ[slow_digits.STEP_MS_ENV] = str(args.step_ms)  # before the control plane starts its kubelet
    scenarios = args.scenarios.split(",")
    if "two_jobs" in scenarios and not args.slots / 2 < args.workers <= args.slots:
        raise SystemExit("--workers must be more than half of --slots (and fit in them)")
    sys.path.insert(0, str(ROOT))
    from kubernetes import client

    from tests.infra.kube.harness import ControlPlane
    from tests.infra.kube.harness.coscheduling import GangScheduler

    t_all = time.time()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-gang-") as tmp:
        work = pathlib.Path(tmp)
        t = time.time()
        data = make_data(args.rows, work / "data")
        print(f"data: {args.rows} records in {time.time() - t:.0f}s", flush=True)
        for run in range(args.runs):
            with ControlPlane() as cp:
                t = time.time()
                gang = GangScheduler(cp, args.gang_scheduler).start() if "two_jobs" in scenarios else None
                t_gang = time.time() - t
                cp.add_node("slots", cpu=str(args.slots), memory="64Gi", pods=60)
                env = master_namespace(cp, NS)
                api = cp.api_client()
                core, sched = client.CoreV1Api(api), client.SchedulingV1Api(api)
                custom, apps = client.CustomObjectsApi(api), client.AppsV1Api(api)
                sched.create_priority_class(
                    {
                        "apiVersion": "scheduling.k8s.io/v1",
                        "kind": "PriorityClass",
                        "metadata": {"name": SERVICE_PRIORITY},
                        "value": 100000,
                        "description": "the online service: preempts training workers",
                    }
                )
                out = {"run": run + 1, "gang_scheduler_start_s": round(t_gang, 1)}
                rate = None
                try:
                    if "two_jobs" in scenarios:
                        g = two_jobs("gang", args, core, custom, data, work / f"r{run}", env)
                        rate = g["rate_per_slot"]
                        out["gang"] = with_utilization(g, rate)
                        for mode in args.modes.split(","):
                            e = two_jobs(mode, args, core, custom, data, work / f"r{run}", env)
                            out[mode] = with_utilization(e, rate)
                            out[f"ratio_{mode}"] = round(e["makespan_s"] / g["makespan_s"], 3)
                        out["ratio"] = out.get("ratio_elastic")
                        report_two_jobs(out, args)
                    if "colocation" in scenarios:
                        out["colocation"] = c = colocation(args, core, apps, data, work / f"r{run}", {**env}, rate)
                        report_colocation(c)
                finally:
                    if gang:
                        gang.stop()
                    if args.json:  # as it goes: a later failure keeps what was measured
                        pathlib.Path(args.json).write_text(
                            json.dumps({"args": vars(args), "runs": runs + [out]}, indent=2)
                        )
            runs.append(out)
    summarize(runs, args, time.time() - t_all)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))


def report_two_jobs(out: dict, args) -> None:
    S, W = args.slots, args.workers
    for mode in ["gang"] + args.modes.split(","):
        r = out[mode]
        print(
            f"run {out['run']} {mode:8s} (min {r['min_workers']}, max {r['max_workers']}) "
            f"makespan {r['makespan_s']:6.1f}s  utilization {r['utilization'] * 100:5.1f}%  "
            f"allocation {r['allocation'] * 100:5.1f}%  "
            + "  ".join(
                f"{n}: submitted {j['submitted_s']}s, first worker bound {j['first_worker_bound_s']}s, "
                f"first step {j['first_step_s']}s (start-up {j['startup_s']}s), ends {j['end_s']}s, "
                f"max {j['max_workers_alive']} workers{'' if j['exact'] else ' LEDGER NOT EXACT'}"
                for n, j in r["jobs"].items()
            ),
            flush=True,
        )
    Wm = args.elastic_max or W
    ideal = (3 * W - S) / (2 * W) if Wm == W else None
    for mode in args.modes.split(","):
        print(
            f"run {out['run']} {mode}/gang makespan = {out[f'ratio_{mode}']:.3f}"
            + (
                f" (ideal with max {W} of {S}: {ideal:.3f}, utilization {2 * W * W / (S * (3 * W - S)) * 100:.1f}%)"
                if ideal and mode == "elastic"
                else ""
            )
            + f"; records/s per slot {out['gang']['rate_per_slot']}",
            flush=True,
        )


def report_colocation(c: dict) -> None:
    print(
        f"colocation: service scaled {c['scaled_at_s']}; {c['service_pods']} service pods, bound in "
        f"{c['bind_s']} s, running in {c['running_s']} s after creation ({c['service_unbound']} never bound); "
        f"job: first step {c['job']['first_step_s']}s, end {c['job']['end_s']}s, max {c['job']['max_workers_alive']} "
        f"workers, {c['job']['workers_lost']} lost{'' if c['job']['exact'] else ', LEDGER NOT EXACT'}; "
        f"used {c['used_slot_s']} of {c['leftover_slot_s']} leftover slot-s = {c['leftover_used'] * 100:.1f}% "
        f"(worker pods Running: {c['worker_pods_running_of_leftover'] * 100:.1f}%)",
        flush=True,
    )


def summarize(runs: list[dict], args, took: float) -> None:
    print(
        f"\n{args.slots} slots; {len(runs)} run(s); {args.rows} records x {args.epochs} epochs per job, "
        f"{args.step_ms:.0f} ms simulated step per minibatch of {MINIBATCH}; bench {took:.0f}s"
    )

    def spread(xs, fmt="{:.1f}"):
        return fmt.format(statistics.median(xs)) + (
            f" [{fmt.format(min(xs))}-{fmt.format(max(xs))}]" if len(xs) > 1 else ""
        )

    two = [r for r in runs if "gang" in r]
    if two:
        print(f"{'':10s}{'makespan s':>22s}{'utilization %':>24s}{'allocation %':>24s}   first steps A, B (s)")
        for mode in ["gang"] + args.modes.split(","):
            rs = [r[mode] for r in two]
            firsts = "; ".join(", ".join(str(j["first_step_s"]) for j in r["jobs"].values()) for r in rs)
            print(
                f"{mode:10s}{spread([r['makespan_s'] for r in rs]):>22s}"
                f"{spread([r['utilization'] * 100 for r in rs]):>24s}"
                f"{spread([r['allocation'] * 100 for r in rs]):>24s}   {firsts}"
            )
        for mode in args.modes.split(","):
            print(f"{mode}/gang makespan ratio: {spread([r[f'ratio_{mode}'] for r in two], '{:.3f}')}")
    colo = [r["colocation"] for r in runs if "colocation" in r]
    if colo:
        bound = spread([c["bind_s"]["median"] for c in colo], "{:.2f}")
        running = spread([c["running_s"]["median"] for c in colo], "{:.2f}")
        print(
            f"colocation: service pods bound (median per run) {bound} s,"
            f" max {max(c['bind_s']['max'] for c in colo):.2f} s; running {running} s;"
            f" leftover capacity used {spread([c['leftover_used'] * 100 for c in colo])} %"
        )


if __name__ == "__main__":
    main()
