"""The Kubernetes backend at a few hundred pods: a fleet of light simulated workers on the real control plane.

The real master minus the training job around it (tests/kubernetes/fleet.py): its gRPC service, coordinator and
ledger, and the Kubernetes backend running each worker as a pod on process-kubelet nodes (110 pods each, the
kubelet's default). Each worker is tests/kubernetes/light_worker.py: it registers and loops GetTask and one
ReportProgress per minibatch (`--think-s` apart), no TensorFlow. Measured:

- the time until every pod is running (the backend's RUNNING events) and every worker registered;
- the master's API requests by verb and resource (counted in its client) while it creates the fleet, while the
  fleet trains (`--steady-s`), and while it deletes it; the pod versions its watch received; beside them the
  apiserver's own count of pod requests from every client (kubelets and scheduler included);
- a master that dies (nothing cleaned up) and one restarted on its address with the job's token: the time to adopt
  every pod and until every worker registered with it, the pods it created or deleted (none), and, from an admin
  watch of every pod version, the most live pods any worker had at once (1: no duplicate).

    .venv/bin/python bench/kube_fleet.py                 # 200 pods
    .venv/bin/python bench/kube_fleet.py --pods 50 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

JOB, TOKEN, NAMESPACE = "fleet", "fleet-bench-token", "fleet"
PODS_PER_NODE = 110


def apiserver_pod_requests(api) -> dict[str, int]:
    """The apiserver's count of requests on pods since it started, by verb (and subresource), from every client."""
    resp = api.call_api(
        "/metrics", "GET", auth_settings=["BearerToken"], _preload_content=False, _return_http_data_only=True
    )
    counts: dict[str, int] = {}
    for m in re.finditer(r"^apiserver_request_total\{([^}]*)\} (\S+)$", resp.data.decode(), re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("resource") == "pods":
            key = " ".join(filter(None, (labels["verb"], labels.get("subresource"))))
            counts[key] = counts.get(key, 0) + int(float(m.group(2)))
    return counts


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in sorted(after) if after[k] - before.get(k, 0)}


def _requests(counter) -> dict[str, int]:
    return {f"{verb} {resource}": n for (verb, resource), n in sorted(counter.items())}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)] if values else float("nan")


def run(args) -> dict:
    from kubernetes import client

    from elastic_step.backends.api import EventKind, InstanceId
    from tests.infra.kube.harness import ControlPlane
    from tests.kubernetes.fleet import FleetMaster, PodRecorder

    out: dict = {"pods": args.pods, "think_s": args.think_s}
    with ControlPlane() as cp:
        nodes = math.ceil(args.pods / PODS_PER_NODE)
        for i in range(nodes):
            cp.add_node(f"fleet-{i}", cpu="64", memory="256Gi", pods=PODS_PER_NODE)
        cp.create_namespace(NAMESPACE)
        admin = cp.api_client()
        core = client.CoreV1Api(admin)
        recorder = PodRecorder(core, NAMESPACE)
        workers = [InstanceId("worker", i) for i in range(args.pods)]

        # ---- the fleet starts
        first = FleetMaster(cp, NAMESPACE, JOB, TOKEN, args.think_s)
        api0, t0 = apiserver_pod_requests(admin), time.monotonic()
        first.launch(args.pods)
        created = time.monotonic()
        running = first.wait("every pod running", lambda: len(first.seen(EventKind.RUNNING)) == args.pods, 600)
        registered = first.wait("every worker registered", lambda: first.registered() == args.pods, 600)
        started, ran = first.seen(EventKind.STARTED), first.seen(EventKind.RUNNING)
        to_run = [ran[w][0] - started[w][0] for w in workers]
        out["start"] = {
            "create_calls_s": round(created - t0, 2),
            "all_running_s": round(running - t0, 2),
            "all_registered_s": round(registered - t0, 2),
            "created_to_running_p50_s": round(_pct(to_run, 0.5), 2),
            "created_to_running_p99_s": round(_pct(to_run, 0.99), 2),
            "master_requests": _requests(first.requests.snapshot()),
            "watch": dict(first.backend.stats),
            "apiserver_pod_requests_all_clients": _delta(apiserver_pod_requests(admin), api0),
        }
        print(f"started: {json.dumps(out['start'])}", flush=True)

        # ---- the fleet trains
        req0, watch0, api0 = first.requests.snapshot(), dict(first.backend.stats), apiserver_pod_requests(admin)
        with first.coord.lock:
            records0 = first.coord.ledger.records_committed_total()
        time.sleep(args.steady_s)
        with first.coord.lock:
            records1 = first.coord.ledger.records_committed_total()
        out["steady"] = {
            "window_s": args.steady_s,
            "records_committed_per_s": round((records1 - records0) / args.steady_s),
            "master_requests": _requests(first.requests.snapshot() - req0),
            "watch": _delta(first.backend.stats, watch0),
            "apiserver_pod_requests_all_clients": _delta(apiserver_pod_requests(admin), api0),
        }
        print(f"steady: {json.dumps(out['steady'])}", flush=True)

        # ---- the master dies; another, restarted on its address, adopts the fleet
        before = {p.metadata.name: p.metadata.uid for p in core.list_namespaced_pod(NAMESPACE).items}
        first.crash()
        t0 = time.monotonic()
        second = FleetMaster(cp, NAMESPACE, JOB, TOKEN, args.think_s, port=first.port)
        listed = time.monotonic()
        try:
            second.launch(args.pods)
            adopted = time.monotonic()
            second.wait("every pod running again", lambda: len(second.seen(EventKind.RUNNING)) == args.pods, 120)
            back = second.wait("every worker registered again", lambda: second.registered() == args.pods, 600)
            kept = {w: e.detail for w, (_, e) in second.seen(EventKind.STARTED).items()}
            after = {p.metadata.name: p.metadata.uid for p in core.list_namespaced_pod(NAMESPACE).items}
            restart_requests = second.requests.snapshot()
            out["restart"] = {
                "adopted": len(second.backend.adopted),
                "kept": sum(d == f"adopted pod {JOB}-worker-{w.index}" for w, d in kept.items()),
                "same_pods": after == before,
                "backend_up_s": round(listed - t0, 2),
                "all_adopted_s": round(adopted - t0, 2),
                "all_registered_again_s": round(back - t0, 2),
                "master_requests": _requests(restart_requests),
                "watch": dict(second.backend.stats),
            }
            print(f"restart: {json.dumps(out['restart'])}", flush=True)
        finally:
            # ---- the master's end: every pod deleted
            t0, req0, api0 = time.monotonic(), second.requests.snapshot(), apiserver_pod_requests(admin)
            watch0 = dict(second.backend.stats)
            second.close()
            out["close"] = {
                "all_deleted_s": round(time.monotonic() - t0, 2),
                "master_requests": _requests(second.requests.snapshot() - req0),
                "watch": _delta(second.backend.stats, watch0),
                "apiserver_pod_requests_all_clients": _delta(apiserver_pod_requests(admin), api0),
            }
            recorder.stop()
        out["max_live_pods_of_one_worker"] = max(recorder.max_live.values())
        out["workers_seen"] = len(recorder.max_live)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pods", type=int, default=200)
    p.add_argument("--think-s", type=float, default=0.5, help="each worker's pause before each report")
    p.add_argument("--steady-s", type=float, default=10.0, help="the window measured while the fleet trains")
    p.add_argument("--json", help="write the figures there")
    args = p.parse_args()
    t0 = time.monotonic()
    out = run(args)
    out["total_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out, indent=1))
    r = out["restart"]
    ok = r["adopted"] == r["kept"] == args.pods and r["same_pods"] and out["max_live_pods_of_one_worker"] == 1
    print(
        f"{args.pods} pods: all running {out['start']['all_running_s']} s after the first create, registered "
        f"{out['start']['all_registered_s']} s; restarted master: {r['kept']} pods kept, "
        f"{r['master_requests'].get('create pods', 0)} created, every worker back {r['all_registered_again_s']} s "
        f"after its start; most live pods of one worker at once: {out['max_live_pods_of_one_worker']}"
        + ("" if ok else "  <-- NOT an adoption without duplicates")
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
