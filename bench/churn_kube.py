"""bench/churn.py's Kubernetes backend: the trace's preemptions made by kube-scheduler on a real control plane, every
side's pods through the same scheduler and node pool.

    .venv/bin/python bench/churn.py --backend kubernetes --churn none moderate heavy --runs 3 --json /tmp/k.json

The cluster (tests.infra.kube.harness: kube-apiserver, kube-scheduler, kube-controller-manager; process-kubelet
nodes running this checkout's processes as the project's image, as its self-tests do): one node per worker slot
(`slot-N`, 1 cpu; a worker pod requests 1 cpu on every side) and `infra` (500m: a PS or a coordinator, which request
none, may sit there, no worker fits). A side with fewer workers than slots (a lone `fit`) has the others cordoned.

A preemption: once the side's progress reaches a trace point (worker N, records R) and a worker of the side runs on
`slot-N`, the bench creates a pod of a PriorityClass above every side's (`churn-preemptor`), 1 cpu, bound to
`slot-N` by its node selector. kube-scheduler preempts the worker there to place it (a graceful deletion: the
victim's pod has its grace period, GRACE_S on every side, and its process what it does on SIGTERM), and the
preemptor then holds the slot for a pending time drawn from an exponential distribution of mean --pending-s
(seeded by the run, the same on every side): the worker's replacement stays Pending until it ends. A point whose
slot has no worker running (its replacement pending) waits for one. One preemption at a time: a point waits until
the last victim's pod is gone, so that a side training on in the second or two the scheduler takes to preempt
meets no second point in them (a restarted side would pay one restart for two).

Every node is this host, and nothing holds a pod to its cpu: elastic-step's pods get the thread pools its local
backend gives on a shared host (1 intra-op and 1 inter-op thread for a PS and for each of 2 workers on 2 cores,
through its `env` parameter) rather than those it sizes for a pod with cores of its own; the peers run TensorFlow's
defaults, as on the local backend.

Progress: elastic-step's master's `/metrics` (records committed); a peer's worker 0 (or coordinator) writes the
records it has trained to a file that the bench reads (a process pod shares the host's filesystem).

Who restarts what, each side as its operator does, the bench playing the peers' operators:
  * ps, allreduce: `elastic-step train --backend kubernetes`, run outside the cluster with the shipped Role's rights
    only; its master relaunches its own workers (`--worker-priority-class elastic-low`, the shipped default).
  * mwms, fit: a worker pod lost, every worker pod of the job is deleted and created again, and the job resumes from
    its last backup (Kubeflow Trainer's JobSet restarts all of a job's pods; TFJob does for MultiWorkerMirrored,
    whose collectives need every worker). A replica keeps its address across restarts, as the headless Service an
    operator gives each replica does (here a loopback port). A restarted pod that fails with no preemption since
    its start ends the run as failed: its next restart would load the same backup.
  * psstrategy: a lost worker's pod is created again at its address, as TFJob restarts a failed replica; the
    coordinator's own failure handling reschedules what the loss cut.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import random
import subprocess
import sys
import time
import urllib.request

from bench.churn_trace import MINIBATCH, MODEL, elastic_figures, points_due
from bench.common import ROOT, free_ports, splits, train_command
from elastic_step import __version__

NS = "churn"
PREEMPTOR = "churn-preemptor"  # above every side's PriorityClass: its pods preempt a worker of any side
WORKER_CLASS, SERVER_CLASS = "elastic-low", "elastic-high"  # the shipped classes, for the peers' pods too
# Every side's pods' grace period, compressed as the training time is (30 s, the default, at about 20x): a worker
# that keeps training through its grace after SIGTERM (TensorFlow's MultiWorkerMirrored does) would otherwise train
# on for 10 minutes of the job's time after its preemption.
GRACE_S = 2
SHARED_HOST_POOLS = "TF_NUM_INTRAOP_THREADS=1,TF_NUM_INTEROP_THREADS=1"  # elastic-step's PS and workers (below)
PEER_IMAGE = "ghcr.io/elastic-step/elastic-step"  # a TensorFlow image: the project's has TF, on the nodes as ours


def slot(w: int) -> str:
    return f"slot-{w}"


def job_name(out: pathlib.Path) -> str:
    """The job of a side's run (its pods' names start with it), from the run's own directory."""
    return f"churn-{out.name}"


@contextlib.contextmanager
def kube_cluster(workers: int):
    """The control plane for the whole bench: `workers` slot nodes, the infra node, the namespace with elastic-step's
    Role, and the preemptor's PriorityClass. Yields (control plane, a master's environment)."""
    from kubernetes import client

    from bench.kube_job import master_namespace
    from tests.infra.kube.harness import ControlPlane
    from tests.kubernetes.images import checkout_images

    with ControlPlane(node_defaults={"images": checkout_images()}) as cp:
        for w in range(workers):
            cp.add_node(slot(w), cpu="1", memory="8Gi", pods=30)
        cp.add_node("infra", cpu="500m", memory="16Gi", pods=30)
        env = master_namespace(cp, NS)
        client.SchedulingV1Api(cp.api_client()).create_priority_class(
            {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": PREEMPTOR},
                "value": 1_000_000,
                "description": "bench/churn.py: a trace's preemption of the worker on one node",
            }
        )
        yield cp, env


class Trace:
    """One run's trace fired at one side: each point (worker N, records R) preempts the side's worker on slot-N by a
    preemptor pod, once the side's progress reaches R and a worker of the side runs there."""

    def __init__(
        self, core, job: str, selector: str, kills: list[tuple[int, int]], seed: int, pending_s: float, total: int
    ):
        rng = random.Random(seed)
        self.core, self.job, self.selector, self.total = core, job, selector, total
        self.pending = list(kills)
        self.hold = {k: rng.expovariate(1.0 / pending_s) for k in kills}  # each point's pending time
        self.victims: dict[int, str] = {}  # slot -> uid of the worker last preempted there
        self.fired: list[dict] = []

    def poll(self, records: int) -> None:
        if not self.pending or records >= self.total:  # a point still waiting when the job is trained never fires
            return
        pods = self.core.list_namespaced_pod(NS, label_selector=self.selector).items
        if {p.metadata.uid for p in pods} & set(self.victims.values()):
            # One preemption at a time: the next point waits until the last victim is gone, so that a side that
            # trains on in the seconds the scheduler takes to preempt meets no second point in them.
            return
        up = {}  # slot -> the side's worker Running there
        for p in pods:
            node = p.spec.node_name or ""
            if node.startswith("slot-") and p.status.phase == "Running" and not p.metadata.deletion_timestamp:
                up[int(node.removeprefix("slot-"))] = p
        down = {w for w, _ in self.pending if w not in up}
        for w, at in points_due(self.pending, records, down)[:1]:
            self.pending.remove((w, at))
            self.victims[w] = up[w].metadata.uid
            self.core.create_namespaced_pod(NS, preemptor(self.job, w, self.hold[w, at]))
            pod, hold = up[w].metadata.name, round(self.hold[w, at], 2)
            self.fired.append({"worker": w, "at": at, "records": records, "pending_s": hold, "pod": pod})

    def figures(self) -> dict:
        """A run's figures of its trace: the records at which each point fired, and each point's details."""
        return {"fired_at": [f["records"] for f in self.fired], "preempted": self.fired}


def preemptor(job: str, w: int, hold_s: float) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": f"preempt-{job}-{w}-", "labels": {"churn/role": "preemptor", "churn/job": job}},
        "spec": {
            "priorityClassName": PREEMPTOR,
            "nodeSelector": {"kubernetes.io/hostname": slot(w)},
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "hold",
                    "image": "busybox",
                    "command": ["sleep", f"{hold_s:.2f}"],
                    "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "1"}},
                }
            ],
        },
    }


def peer_pod(job: str, name: str, role: str, command: list[str], cpu: str | None) -> dict:
    """A peer's pod: its job's and role's labels, the shipped PriorityClass of its role, the same grace period and
    resources as elastic-step's pods of that role."""
    resources = {"requests": {"cpu": cpu, "memory": "2Gi"}, "limits": {"cpu": cpu, "memory": "2Gi"}} if cpu else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"churn/job": job, "churn/role": role}},
        "spec": {
            "priorityClassName": WORKER_CLASS if role == "worker" else SERVER_CLASS,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": GRACE_S,
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "tensorflow",
                    "image": PEER_IMAGE,
                    "command": command,
                    "env": [{"name": "TF_CPP_MIN_LOG_LEVEL", "value": "2"}],
                    "resources": resources,
                }
            ],
        },
    }


class Side:
    """One side's run on the cluster: its pods, its trace, the slots it may use, and the end of it all."""

    def __init__(self, cp, job: str, selector: str, kills, seed: int, args, n_workers: int):
        from kubernetes import client

        self.cp, self.job, self.budget_s = cp, job, args.budget_s
        self.core = client.CoreV1Api(cp.api_client())
        self.trace = Trace(self.core, job, selector, kills, seed, args.pending_s, args.rows * args.epochs)
        self.cordoned = [slot(w) for w in range(n_workers, args.workers)]
        self.t0 = time.perf_counter()

    def __enter__(self) -> Side:
        for node in self.cordoned:
            self.cp.cordon_node(node)
        return self

    def __exit__(self, *exc) -> None:
        """Every pod of the side and of its trace deleted and gone, its slots given back for the next side."""
        selectors = (f"churn/job={self.job}", f"elastic-step/job={self.job}")  # the peers' and the trace's; ours
        for selector in selectors:
            self.core.delete_collection_namespaced_pod(NS, label_selector=selector, grace_period_seconds=0)
        deadline = time.time() + 120
        while time.time() < deadline and any(
            self.core.list_namespaced_pod(NS, label_selector=s).items for s in selectors
        ):
            time.sleep(0.2)
        for node in self.cordoned:
            self.cp.cordon_node(node, False)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s

    def stalled(self) -> dict:
        """The figures of a run given up past --budget-s."""
        return {"time_to_target_s": None, "stalled": True, "stalled_at_s": self.elapsed(), **self.trace.figures()}

    def failed(self, pod: str) -> dict:
        """The figures of a run whose restarted pod failed on its own: the side cannot come back from its loss."""
        log = self.log(pod)
        print(
            f"{self.job}: pod {pod} failed after a restart, not by the trace; the run ends here:\n{log}",
            file=sys.stderr,
        )
        return {
            "time_to_target_s": None,
            "stalled": True,
            "failed": log.strip().splitlines()[-1],
            **self.trace.figures(),
        }

    def pods(self, role: str | None = None) -> dict:
        """name -> pod, of the side's peer pods (of `role`)."""
        selector = f"churn/job={self.job}" + (f",churn/role={role}" if role else "")
        return {p.metadata.name: p for p in self.core.list_namespaced_pod(NS, label_selector=selector).items}

    def log(self, name: str) -> str:
        """The tail of a pod's log, from whichever node ran it."""
        for node in self.cp.nodes.values():
            path = node.log_path(NS, name)
            if path and path.exists():
                return path.read_text()[-3000:]
        return "(no log)"


def read_json(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# ---------------------------------------------------------------- elastic-step
def metrics_records(port: int) -> int:
    """Records committed, from the master's /metrics (0 until it serves)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("elastic_step_records_committed_total"):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def elastic(cp, env, strategy, data, args, out: pathlib.Path, kills, seed: int) -> dict:
    job = job_name(out)
    port = free_ports(1)[0]
    cmd = train_command(
        model_def=str(ROOT / MODEL),
        **splits(data),
        epochs=args.epochs,
        minibatch_size=MINIBATCH,
        records_per_task=MINIBATCH * 16,
        strategy=strategy,
        min_workers=1,
        max_workers=args.workers,
        output=str(out),
        job_id=job,
        backend="kubernetes",
        health_port=port,
        max_relaunches=20 + len(kills),
        checkpoint_every=args.rows,  # a checkpoint an epoch, as the peers back up (churn.py's elastic())
        # The master runs outside a pod here: it has no pod of its own whose image the workers would take.
        worker_image=f"{PEER_IMAGE}:{__version__}",
        # The thread pools its local backend gives on a shared host (master/threads.py), not those of a pod with
        # cores of its own: here every node is this host, and nothing holds a pod to its cpu.
        env=SHARED_HOST_POOLS,
    )
    selector = f"elastic-step/job={job},elastic-step/role=worker"
    log = open(out.parent / f"{out.name}.master.log", "w")  # closed below
    with Side(cp, job, selector, kills, seed, args, args.workers) as side, log:
        grace = json.dumps({"terminationGracePeriodSeconds": GRACE_S})  # over the backend's default (pods.py)
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**env, "ELASTIC_STEP_POD_SPEC": grace}, stdout=subprocess.DEVNULL, stderr=log
        )
        try:
            while proc.poll() is None:
                side.trace.poll(metrics_records(port))
                if side.over_budget():
                    return side.stalled()
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        wall = side.elapsed()
        if proc.returncode != 0:
            raise SystemExit(f"elastic-step train --backend kubernetes failed:\n{log.name}")
    return {**elastic_figures(out, wall), **side.trace.figures()}


# ---------------------------------------------------------------- the peers
def peer_config(work: pathlib.Path, data, args, **more) -> dict:
    """What a peer's process is given (bench/churn.py's --peer-worker and --ps-chief): no trace of its own (the bench
    preempts its pods), and files in `work` for its progress and its result."""
    return {
        "work": str(work),
        "model": str(ROOT / MODEL),
        "data": str(data),
        "epochs": args.epochs,
        "kills": [],
        "progress": str(work / "progress.json"),
        "result": str(work / "result.json"),
        **more,
    }


def peer_command(*args: str) -> list[str]:
    """A peer process's command: bench/churn.py's --peer-worker KIND CFG or --ps-chief CFG."""
    return [sys.executable, str(ROOT / "bench" / "churn.py"), *args]


def progress(work: pathlib.Path) -> int:
    """The records a peer reports trained, in its run's directory (0 before its first report)."""
    return (read_json(work / "progress.json") or {"records": 0})["records"]


def restart_all(cp, kind: str, data, args, work: pathlib.Path, kills, seed: int) -> dict:
    """mwms or fit as their operator runs them: a worker pod lost, every worker pod deleted and created again."""
    work.mkdir(parents=True, exist_ok=True)
    job = job_name(work)
    n = 1 if kind == "fit" else args.workers
    ports = free_ports(n) if kind == "mwms" else []  # each replica's address, kept across restarts
    cfg = peer_config(work, data, args, ports=ports)
    again = restarts = 0
    owed = None  # the records trained at the last loss: trained again down to what the next start restores
    with Side(cp, job, f"churn/job={job},churn/role=worker", kills, seed, args, n) as side:
        while True:
            for f in work.glob("start-*.json"):
                f.unlink()
            fired = len(side.trace.fired)
            names = [f"{job}-worker-{i}-{restarts}" for i in range(n)]
            for i, name in enumerate(names):
                command = peer_command("--peer-worker", kind, json.dumps({**cfg, "index": i}))
                side.core.create_namespaced_pod(NS, peer_pod(job, name, "worker", command, "1"))
            lost = None
            while True:
                side.trace.poll(progress(work))
                if owed is not None and (start := read_json(work / "start-0.json")):
                    again, owed = again + max(0, owed - start["records"]), None
                pods = side.pods("worker")
                if all(nm in pods and pods[nm].status.phase == "Succeeded" for nm in names):
                    break
                if side.over_budget():
                    return side.stalled()
                gone = [nm for nm in names if nm not in pods or pods[nm].metadata.deletion_timestamp]
                failed = [nm for nm in names if nm in pods and pods[nm].status.phase == "Failed"]
                if gone or failed:
                    lost = (gone + failed)[0]
                    if len(side.trace.fired) == fired:  # no preemption since this start: the worker failed
                        if restarts:  # from its backup: the operator's next restart would load the same
                            return side.failed(lost)
                        raise SystemExit(f"{kind}: worker pod {lost} failed, not by the trace:\n{side.log(lost)}")
                    break
                time.sleep(0.2)
            if lost is None:
                wall = side.elapsed()
                break
            # The operator restarts every worker: delete them all, and create them again once they are gone.
            owed = progress(work)
            (work / "progress.json").unlink(missing_ok=True)  # the next start's progress is its own
            side.core.delete_collection_namespaced_pod(NS, label_selector=f"churn/job={job},churn/role=worker")
            while side.pods("worker"):
                time.sleep(0.2)
            restarts += 1
    r = read_json(work / "result.json")
    return {
        "time_to_target_s": wall,
        "accuracy": r["accuracy"],
        "records_trained_again": again,
        **side.trace.figures(),
        "restarts": restarts,
    }


def ps_operator(cp, data, args, work: pathlib.Path, kills, seed: int) -> dict:
    """TF's ParameterServerStrategy as TFJob runs it: a PS pod, a worker pod per replica, the coordinator's pod; a
    lost worker's pod created again at its replica's address."""
    from bench.ps_strategy import server_command, tf_cluster

    work.mkdir(parents=True, exist_ok=True)
    job = job_name(work)
    cluster = tf_cluster(args.workers)  # each replica's address, kept across restarts
    cfg = peer_config(work, data, args, cluster=cluster)
    chief = f"{job}-chief"
    launches = [0] * args.workers

    def worker(i: int) -> str:
        return f"{job}-worker-{i}-{launches[i]}"

    with Side(cp, job, f"churn/job={job},churn/role=worker", kills, seed, args, args.workers) as side:
        side.core.create_namespaced_pod(NS, peer_pod(job, f"{job}-ps-0", "ps", server_command(cluster, "ps", 0), None))
        for i in range(args.workers):
            side.core.create_namespaced_pod(
                NS, peer_pod(job, worker(i), "worker", server_command(cluster, "worker", i), "1")
            )
        command = peer_command("--ps-chief", json.dumps(cfg))
        side.core.create_namespaced_pod(NS, peer_pod(job, chief, "chief", command, None))
        restarts = 0
        while True:
            side.trace.poll(progress(work))
            pods = side.pods()
            phase = pods[chief].status.phase if chief in pods else "gone"
            if phase == "Succeeded":
                break
            if phase in ("Failed", "gone"):
                raise SystemExit(f"psstrategy: the coordinator failed:\n{side.log(chief)}")
            if (pods.get(f"{job}-ps-0") is None) or pods[f"{job}-ps-0"].status.phase == "Failed":
                raise SystemExit(f"psstrategy: the parameter server failed:\n{side.log(f'{job}-ps-0')}")
            if side.over_budget():
                return side.stalled()
            for i in range(args.workers):
                p = pods.get(worker(i))
                if p is None or p.metadata.deletion_timestamp or p.status.phase == "Failed":
                    if p is not None and not p.metadata.deletion_timestamp:  # failed on its own: delete it first
                        side.core.delete_namespaced_pod(worker(i), NS, grace_period_seconds=0)
                    launches[i] += 1  # the operator restarts the replica, at its address once its old pod is gone
                    restarts += 1
                    side.core.create_namespaced_pod(
                        NS, peer_pod(job, worker(i), "worker", server_command(cluster, "worker", i), "1")
                    )
            time.sleep(0.2)
        wall = side.elapsed()
    r = read_json(work / "result.json")
    return {
        "time_to_target_s": wall,
        "accuracy": r["accuracy"],
        "records_trained_again": (r["steps_applied"] - r["steps_needed"]) * MINIBATCH,
        "closures_put_back": r["closures_put_back"],
        **side.trace.figures(),
        "restarts": restarts,
    }


def run_side(cp, env, side: str, data, args, out: pathlib.Path, kills, seed: int) -> dict:
    """One side's run, and the preemptions kube-scheduler itself reports of its pods (its `Preempted` Events): the
    witness that the trace's points were the scheduler's preemptions, not the bench's deletions."""
    if side in ("ps", "allreduce"):
        r = elastic(cp, env, side, data, args, out, kills, seed)
    elif side == "psstrategy":
        r = ps_operator(cp, data, args, out, kills, seed)
    else:
        r = restart_all(cp, side, data, args, out, kills, seed)
    r["scheduler_preempted"] = scheduler_preempted(cp, f"{job_name(out)}-")
    return r


def scheduler_preempted(cp, prefix: str) -> list[str]:
    """The pods named `prefix...` that kube-scheduler's Events say it preempted."""
    from kubernetes import client

    events = client.CoreV1Api(cp.api_client()).list_namespaced_event(NS, field_selector="reason=Preempted").items
    return sorted({e.involved_object.name for e in events if e.involved_object.name.startswith(prefix)})
