"""A fleet of light workers on the real control plane, for the fleet's test and bench/kube_fleet.py.

The master is the real one minus the training job around it: its gRPC service over a coordinator and a ledger,
and the Kubernetes backend running each worker as a pod. Each worker is light_worker.py (gRPC, no TensorFlow),
so that hundreds of pods fit on the process kubelet. Here too: the API requests a master makes (`ApiCounter`), and
a recorder of every pod version that counts the live pods of each instance (`PodRecorder`).

A restarted master listens on its predecessor's port with the job's token: its workers' commands are then exactly
the pods' own, so it keeps (adopts) every pod rather than replacing it (backends/kubernetes/adoption.py).
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
import urllib.parse
from pathlib import Path

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from elastic_step.backends.api import EventKind, InstanceEvent, InstanceId, InstanceSpec
from elastic_step.backends.kubernetes import KubernetesBackend, load_manifests
from elastic_step.master.failures import FailureReports
from elastic_step.master.leases.coordinator import Coordinator
from elastic_step.master.leases.ledger import Ledger, ShardInfo
from elastic_step.master.service import MasterService, serve
from elastic_step.master.skipped import SkippedMinibatches
from tests.infra.kube.harness import wait_for
from tests.kubernetes.jobs import WORKER_IMAGE

LIGHT_WORKER = Path(__file__).with_name("light_worker.py")
MINIBATCH = 64
RECORDS_PER_TASK = 10 * MINIBATCH  # ten reports a lease
SHARDS = [ShardInfo(f"synthetic://{i}", 1_000_000) for i in range(100)]  # far more than a fleet trains meanwhile


class ApiCounter:
    """The API requests one ApiClient makes, by (verb, resource): ("create", "pods"), ("watch", "pods"), ..."""

    def __init__(self, api_client):
        self.counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        request = api_client.rest_client.request

        def counted(method, url, query_params=None, *args, **kwargs):
            key = self.key(method, url, query_params or [])
            with self._lock:
                self.counts[key] += 1
            return request(method, url, query_params, *args, **kwargs)

        api_client.rest_client.request = counted

    @staticmethod
    def key(method: str, url: str, query_params) -> tuple[str, str]:
        parts = urllib.parse.urlsplit(url).path.strip("/").split("/")
        # /api/v1/namespaces/<ns>/<resource>[/<name>...] or /apis/<group>/<version>/<resource>...
        if "namespaces" in parts[:4]:
            rest = parts[parts.index("namespaces") + 2 :]
        else:
            rest = parts[2 if parts[0] == "api" else 3 :]
        resource, named = (rest[0] if rest else "namespaces"), len(rest) > 1
        watch = any(k == "watch" and str(v).lower() == "true" for k, v in query_params)
        verb = {"POST": "create", "DELETE": "delete", "PATCH": "patch", "PUT": "update"}.get(
            method, "watch" if watch else "get" if named else "list"
        )
        return verb, resource

    def snapshot(self) -> collections.Counter:
        with self._lock:
            return collections.Counter(self.counts)


class FleetMaster:
    """The master of job `job`'s fleet: serving on `port` (0: a free one), its pods in `namespace` dressed by
    `pod_spec` (placement). Its backend's events are kept with their monotonic time."""

    def __init__(self, cp, namespace: str, job: str, token: str, think_s: float, port: int = 0, pod_spec=None):
        self.think_s = think_s
        self.api = cp.api_client()
        self.requests = ApiCounter(self.api)
        for doc in load_manifests("priorityclasses"):  # the workers' default class, as a cluster would have it
            try:
                client.SchedulingV1Api(self.api).create_priority_class(doc)
            except client.ApiException as e:
                if e.status != 409:
                    raise
        self.requests.counts.clear()  # the cluster's setup, not the master's
        self.coord = Coordinator(Ledger(SHARDS, RECORDS_PER_TASK, epochs=1, minibatch_size=MINIBATCH), num_ps=0)
        failures = FailureReports(self.coord.timeline, job_failed=self.coord.finished.set)
        service = MasterService(
            self.coord,
            token,
            job,
            MINIBATCH,
            "light-worker",
            failures=failures,
            skipped=SkippedMinibatches(self.coord.timeline),
        )
        self.server, self.port = serve(service, port=port)
        self.address = f"127.0.0.1:{self.port}"
        self.backend = KubernetesBackend(
            job,
            token,
            api_client=self.api,
            namespace=namespace,
            owner=None,
            master_ip="127.0.0.1",
            pod_spec=pod_spec,
            image=WORKER_IMAGE,
        )
        self.events: list[tuple[float, InstanceEvent]] = []
        self._closed = threading.Event()
        self._pump = threading.Thread(target=self._take_events, daemon=True, name=f"events-{job}")
        self._pump.start()

    def _take_events(self) -> None:
        while not self._closed.is_set():
            for ev in self.backend.events(0.2):
                self.events.append((time.monotonic(), ev))

    def spec(self, index: int) -> InstanceSpec:
        argv = [sys.executable, str(LIGHT_WORKER), self.address, str(index), str(self.think_s)]
        return InstanceSpec(InstanceId("worker", index), argv)

    def launch(self, workers: int) -> None:
        for i in range(workers):
            self.backend.start(self.spec(i))

    def seen(self, kind: EventKind) -> dict[InstanceId, tuple[float, InstanceEvent]]:
        """Per instance, the first event of this kind (its time and itself)."""
        first: dict[InstanceId, tuple[float, InstanceEvent]] = {}
        for t, ev in list(self.events):
            if ev.kind == kind:
                first.setdefault(ev.instance, (t, ev))
        return first

    def registered(self) -> int:
        with self.coord.lock:
            return len(self.coord.membership.training())

    def wait(self, what: str, done, timeout: float) -> float:
        """Until `done()`; returns when (monotonic). A worker that ended meanwhile fails it at once."""

        def check():
            ended = self.seen(EventKind.EXITED) | self.seen(EventKind.LOST)
            gone = [(str(i), e.kind.value, e.exit_code, e.detail) for i, (_, e) in sorted(ended.items())]
            assert not ended, f"{what}: pods ended: {gone}"
            return done()

        wait_for(check, timeout, interval=0.1, what=what)
        return time.monotonic()

    def crash(self) -> None:
        """The master dies: nothing is cleaned up, its pods go on (and retry its address)."""
        self.backend.abandon()
        self.server.stop(None)
        self._closed.set()

    def close(self) -> None:
        """The master's end: every pod of the job deleted, and waited for."""
        try:
            self.backend.close(grace_s=2)
        finally:
            self.server.stop(None)
            self._closed.set()


class PodRecorder(threading.Thread):
    """Every version of every pod of a namespace, as an (admin) watch sees them; counts how many
    live pods (not deleting, not finished) each instance of each job has at once."""

    def __init__(self, core, namespace: str):
        super().__init__(daemon=True, name=f"recorder-{namespace}")
        self.core, self.namespace = core, namespace
        self.current: dict[str, dict] = {}
        self.seen: dict[str, dict] = {}  # name -> last version seen
        self.max_live: dict[tuple, int] = {}
        self.stopped = threading.Event()
        self.start()

    def run(self):
        rv = None
        while not self.stopped.is_set():
            try:
                if rv is None:
                    lst = json.loads(self.core.list_namespaced_pod(self.namespace, _preload_content=False).data)
                    rv = lst["metadata"]["resourceVersion"]
                    self.current = {}
                    for obj in lst["items"]:
                        self._see("ADDED", obj)
                resp = self.core.list_namespaced_pod(
                    self.namespace, watch=True, resource_version=rv, timeout_seconds=5, _preload_content=False
                )
                for line in iter_resp_lines(resp):
                    ev = json.loads(line)
                    if ev["type"] == "ERROR":
                        rv = None
                        break
                    rv = ev["object"]["metadata"]["resourceVersion"]
                    self._see(ev["type"], ev["object"])
            except Exception:  # noqa: BLE001
                rv = None
                time.sleep(0.2)

    def _see(self, kind: str, obj: dict) -> None:
        name = obj["metadata"]["name"]
        self.seen[name] = obj
        if kind == "DELETED":
            self.current.pop(name, None)
        else:
            self.current[name] = obj
        live: dict[tuple, int] = {}
        for o in self.current.values():
            labels = o["metadata"].get("labels") or {}
            if "elastic-step/job" not in labels or o["metadata"].get("deletionTimestamp"):
                continue
            if (o.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            key = (labels["elastic-step/job"], labels["elastic-step/role"], labels["elastic-step/index"])
            live[key] = live.get(key, 0) + 1
        for key, n in live.items():
            self.max_live[key] = max(self.max_live.get(key, 0), n)

    def stop(self):
        self.stopped.set()
