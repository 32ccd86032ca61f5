"""What the Kubernetes benches (two_jobs.py, gang.py) share: the model with a simulated accelerator, and a
master run as `elastic-step train --backend kubernetes` in a subprocess, its stderr lines timestamped, and
a sampler of the pods the jobs run."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import threading
import time

from bench.common import ROOT, train_command
from elastic_step import __version__

# The model: digits with a simulated accelerator (a sleep per minibatch in worker pods).
MODEL = ROOT / "bench" / "models" / "slow_digits.py"
_spec = importlib.util.spec_from_file_location("slow_digits", MODEL)
slow_digits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(slow_digits)
MINIBATCH = slow_digits.RECORDS_PER_STEP


class Master:
    """One `elastic-step train` subprocess; its stderr lines are timestamped as they arrive."""

    def __init__(
        self,
        name: str,
        args,
        data: pathlib.Path,
        out: pathlib.Path,
        env: dict,
        min_workers: int,
        max_workers: int,
        epochs: int | None = None,
    ):
        self.name, self.out = name, out
        self.submitted = time.time()
        self.trained_at: float | None = None
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            train_command(
                backend="kubernetes",
                job_id=name,
                model_def=str(MODEL),
                train_data=str(data),
                output=str(out),
                epochs=epochs or args.epochs,
                minibatch_size=MINIBATCH,
                records_per_task=args.records_per_task,
                min_workers=min_workers,
                max_workers=max_workers,
                worker_cpu=1,
                worker_priority_class="elastic-low",
                ps_priority_class="elastic-high",
                # The master runs outside a pod here: it has no pod of its own whose image the workers would take.
                worker_image=f"ghcr.io/elastic-step/elastic-step:{__version__}",
            ),
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            now = time.time()
            self.lines.append((now, line.rstrip()))
            if self.trained_at is None and "training starts" in line:
                self.trained_at = now

    def wait(self, timeout: float) -> float:
        self.proc.wait(timeout)
        self.ended = time.time()
        self.reader.join(5)
        if self.proc.returncode != 0:
            tail = "\n".join(l for _, l in self.lines[-30:])
            raise SystemExit(f"job {self.name} failed ({self.proc.returncode}):\n{tail}")
        self.summary = json.loads((self.out / "summary.json").read_text())
        return self.ended

    @property
    def records(self) -> int:
        return self.summary["ledger"]["records_committed"]

    def t0(self) -> float:
        """The master's clock origin (summary times are relative to it), from its first step's line."""
        started = next(e["t"] for e in self.summary["events"] if e["kind"] == "training_started")
        return (self.trained_at or self.ended) - started

    def records_between(self, t_from: float, t_to: float) -> float:
        """Records committed between two wall-clock times (progress samples every 0.5 s, interpolated)."""
        base = self.t0()
        pts = [(base + s["t"], s["records"]) for s in self.summary["timeseries"]]
        pts = [(self.submitted, 0)] + pts + [(self.ended, self.records)]

        def at(t):
            for (ta, ra), (tb, rb) in zip(pts, pts[1:]):
                if ta <= t <= tb:
                    return ra + (rb - ra) * ((t - ta) / (tb - ta) if tb > ta else 1)
            return 0 if t < pts[0][0] else pts[-1][1]

        return at(t_to) - at(t_from)

    def exact(self) -> bool:
        return all(e["lost"] == 0 and e["double_applied"] == 0 for e in self.summary["ledger"]["epochs"])


class PodSampler(threading.Thread):
    """Pods of the namespace, every `interval` s: per pod, when first seen, bound and Running."""

    def __init__(self, core, namespace: str, selector: str, interval: float = 0.1):
        super().__init__(daemon=True)
        self.core, self.namespace, self.selector, self.interval = core, namespace, selector, interval
        self.samples: list[tuple[float, int, int]] = []  # (t, bound and not deleting, Running)
        self.pods: dict[str, dict] = {}  # name -> {"seen", "bound", "running", "gone"}
        self.stopped = threading.Event()
        self.start()

    def run(self):
        while not self.stopped.wait(self.interval):
            try:
                items = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector).items
            except Exception:  # noqa: BLE001
                continue
            now, bound, running = time.time(), 0, 0
            names = set()
            for p in items:
                names.add(p.metadata.name)
                rec = self.pods.setdefault(p.metadata.name, {"seen": now, "bound": None, "running": None, "gone": None})
                if p.spec.node_name and rec["bound"] is None:
                    rec["bound"] = now
                if p.status.phase == "Running" and rec["running"] is None:
                    rec["running"] = now
                if p.spec.node_name and p.status.phase not in ("Succeeded", "Failed"):
                    bound += 1
                    running += p.status.phase == "Running" and not p.metadata.deletion_timestamp
            for name, rec in self.pods.items():
                if name not in names and rec["gone"] is None:
                    rec["gone"] = now
            self.samples.append((now, bound, running))

    def integral(self, t0: float, t1: float, idx: int) -> float:
        """slot-seconds of samples[idx] (1: bound, 2: Running) between t0 and t1."""
        pts = [(s[0], s[idx]) for s in self.samples if t0 <= s[0] <= t1]
        return sum(n * (tb - ta) for (ta, n), (tb, _) in zip(pts, pts[1:]))


# The pod identity a master reads from its environment: a bench's master runs outside a pod, and must not take the
# bench's own shell's for its step's.
POD_ENV = (
    "KFP_POD_NAME",
    "KFP_POD_UID",
    "POD_NAME",
    "POD_UID",
    "POD_IP",
    "ELASTIC_STEP_POD_IP",
    "ELASTIC_STEP_POD_SPEC",
    "ELASTIC_STEP_POD_LABELS",
)


def master_namespace(cp, namespace: str) -> dict:
    """`namespace` made ready for masters run outside the cluster as the shipped manifests allow: the project's
    PriorityClasses (once per cluster), its ServiceAccount, Role and RoleBinding; the environment a master runs in
    (KUBECONFIG with that account's token, ELASTIC_STEP_NAMESPACE, no pod identity)."""
    from kubernetes import client

    from elastic_step.backends.kubernetes import load_manifests

    api = cp.api_client()
    core, rbac, sched = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api), client.SchedulingV1Api(api)
    cp.create_namespace(namespace)
    have = {p.metadata.name for p in sched.list_priority_class().items}
    for d in load_manifests("priorityclasses"):
        if d["metadata"]["name"] not in have:
            sched.create_priority_class(d)
    for d in load_manifests("role", namespace):
        {
            "ServiceAccount": core.create_namespaced_service_account,
            "Role": rbac.create_namespaced_role,
            "RoleBinding": rbac.create_namespaced_role_binding,
        }[d["kind"]](namespace, d)
    token = cp.service_account_token(namespace, "elastic-step")
    time.sleep(2)  # the RoleBinding reaches the authorizer
    env = {k: v for k, v in os.environ.items() if k not in POD_ENV}
    env.update(KUBECONFIG=str(cp.kubeconfig_for(token, user="elastic-step")), ELASTIC_STEP_NAMESPACE=namespace)
    return env
