"""A *process kubelet*: a test fixture that plays a node's kubelet with local processes.

``ProcessKubelet(api_client, "node-a", cpu="2", memory="4Gi", pods=10).start()``

* registers Node ``node-a`` (capacity = allocatable: cpu, memory, pods, and any ``extended`` resources such as
  ``{"nvidia.com/gpu": "2"}``, which kube-scheduler then counts; Ready, with the usual labels plus ``labels``, and
  ``taints``) and renews its Lease in ``kube-node-lease``;
* watches the pods bound to it (``spec.nodeName``; re-lists on 410 Gone) and runs each one
  (pod.py): its init containers in order, each to completion, then all its containers at once,
  each ``command + args`` (``$(VAR)`` expanded) as a local process in its own process group, with:

  - the environment of this Python process (``base_env``), the image's PATH (``images``: image
    repository -> ``Image``, directories of its programs and files; otherwise the host's PATH), the Kubernetes
    service variables (``KUBERNETES_SERVICE_HOST``/``_PORT`` = the real apiserver), ``HOSTNAME``,
    then the container's ``env``/``envFrom``: literal values, ``fieldRef`` (metadata.name,
    .namespace, .uid, .labels['k'], .annotations['k'], spec.nodeName,
    spec.serviceAccountName, status.podIP, status.hostIP), ``secretKeyRef`` and
    ``configMapKeyRef`` read from the API; and ``PROCESS_KUBELET_POD_IP`` (the pod's address);
  - its own loopback address 127.S.x.y (``status.podIP``; Linux routes all of 127/8 to lo; S is the
    number of the xdist worker, so that two workers' control planes never hand out the same address);
  - a PID namespace of its own under a small init that passes SIGTERM on (so a kill(-1) from inside,
    as Argo's executor sends, stays in the container), and a mount namespace of its own
    (mounts.py: ``unshare --mount --pid``, private propagation) in which
    a fresh 64 MiB tmpfs, mounted as container runtimes mount it, covers ``/dev/shm``, and the
    pod's volumes are bind-mounted at their real ``mountPath``: emptyDir, secret, configMap,
    downwardAPI, hostPath and projected ones, so
    ``/var/run/secrets/kubernetes.io/serviceaccount/token`` is a real, pod-bound token. As on a
    real node, pods do not see each other's shared memory or volumes (nor the host's /dev/shm).
    Needs root, or unprivileged user namespaces (then ``--map-root-user``); the kubelet checks
    once and refuses to start without it rather than run pods dishonestly. Unlike a real pod's,
    /dev/shm is per start of the container, not kept across its restarts; a mount path missing
    on the host is made there as an empty directory (or file) to mount on;
* patches the pod status: Pending (IP; init containers running) -> Running (a container started)
  -> Succeeded/Failed once every container has ended, with each one's exit code in
  ``containerStatuses`` (and ``initContainerStatuses``); restartPolicy Always/OnFailure restart
  a container's process, counting its ``restartCount``; a failed init container fails the pod
  under restartPolicy Never;
* runs the containers' ``httpGet`` liveness and readiness probes (probes.py): a failed liveness probe kills the
  container, restarted under the pod's restartPolicy; readiness sets its Ready condition;
* tells a pod's containers' exit codes (:meth:`ProcessKubelet.exit_codes`), a deleted one's whose kill is held too;
* freezes a pod and resumes it (:meth:`ProcessKubelet.freeze`, :meth:`ProcessKubelet.resume`): SIGSTOP / SIGCONT
  to every process of its containers, for tests of hung workers; and holds a pod's kill
  (:meth:`ProcessKubelet.hold_kill`, :meth:`ProcessKubelet.release_kill`): its deletion is seen and not acted upon,
  as on a node cut off from the apiserver, so a deleted pod's processes live on beside its replacement (a zombie);
* honours graceful deletion: when ``deletionTimestamp`` is set, SIGTERM to every container,
  SIGKILL to their process groups after ``deletionGracePeriodSeconds``, terminal status, then
  DELETE with grace period 0 (uid precondition) so the pod disappears and e.g. the
  scheduler's preemption completes. A pod deleted outright is killed at once.

Containers in a real image: with ``oci_images`` (image repository, or ``repository:tag`` for one tag of it, ->
``oci.OciImage``, the layout scripts/build-image writes, unpacked), a container of that image runs inside it under
runc instead (oci.py): the image's root
filesystem, user, environment and entrypoint, the pod's env, volumes and securityContext, and none of the host's
environment or files but ``shared_paths``. Its deletion, freezing and exit codes work as a process container's.

Logs: each container's stdout+stderr goes to ``<workdir>/pods/<ns>_<name>_<uid>/<container>.log``
(:meth:`ProcessKubelet.log_path`), the kubelet's own log to ``<workdir>/kubelet.log``.

Several kubelets can run in one process; pod addresses come from one allocator per
process. Not implemented: startup, exec, tcpSocket and grpc probes, lifecycle hooks, resource enforcement,
image entrypoints outside ``oci_images`` (a container needs a command), exec/logs/port-forward through the
apiserver.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

from .mounts import mount_namespace_mode
from .oci import OciImage
from .pod import TERMINAL, Image, PodWorker, log_files, now_iso, now_micro
from .process import Service

KUBE_VERSION = "v1.34"


class _IPAllocator:
    """127.S.0.2 ... 127.S.0.254, then 127.S.1.1 ...; round robin so a just-freed address is not handed out
    again at once. One per Python process, shared by all its kubelets. S is the process's own second octet:
    under pytest-xdist each worker may run a control plane of its own, and their pods must never share an
    address (worker gwN gets 127.N/16; a process outside xdist, 127.0/16)."""

    def __init__(self, first: int = 2, size: int = 250 * 254):
        self._lock = threading.Lock()
        self._used: set[int] = set()
        self._next = 0
        self._first, self._size = first, size
        self._octet = _xdist_worker_octet()

    def _ip(self, n: int) -> str:
        n += 2  # 127.S.0.2 is n=0
        hi, lo = divmod(n - 1, 254)
        return f"127.{self._octet}.{hi}.{lo + 1}"

    def allocate(self) -> str:
        with self._lock:
            for _ in range(self._size):
                n = self._next
                self._next = (self._next + 1) % self._size
                if n not in self._used:
                    self._used.add(n)
                    return self._ip(n)
        raise RuntimeError("out of loopback pod addresses")

    def release(self, ip: str) -> None:
        with self._lock:
            for n in list(self._used):
                if self._ip(n) == ip:
                    self._used.discard(n)


def _xdist_worker_octet() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    return int(worker[2:]) % 255 if worker.startswith("gw") and worker[2:].isdigit() else 0


IPS = _IPAllocator()


class ProcessKubelet(Service):
    def __init__(
        self,
        api_client,
        name: str,
        *,
        cpu: str = "4",
        memory: str = "8Gi",
        pods: int = 110,
        labels: dict | None = None,
        taints: list | None = None,
        extended: dict[str, str | int] | None = None,
        workdir: str | Path | None = None,
        api_host: str = "127.0.0.1",
        api_port: int = 443,
        base_env: dict | None = None,
        cwd: str | None = None,
        lease_duration: int = 40,
        node_status_period: float = 60.0,
        ips: _IPAllocator | None = None,
        images: dict[str, Image] | None = None,
        oci_images: dict[str, OciImage] | None = None,
        shared_paths: tuple[str, ...] = (),
    ):
        import kubernetes.client

        self.api = api_client
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.coord = kubernetes.client.CoordinationV1Api(api_client)
        self.ApiException = kubernetes.client.ApiException
        self.name = name
        self.capacity = {"cpu": str(cpu), "memory": str(memory), "pods": str(pods), "ephemeral-storage": "100Gi"}
        self.capacity.update({k: str(v) for k, v in (extended or {}).items()})  # e.g. nvidia.com/gpu: nothing backs it
        self.labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **(labels or {}),
        }
        self.taints = taints or []
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"process-kubelet-{name}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.api_host, self.api_port = api_host, api_port
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.cwd = cwd
        self.images = dict(images or {})  # image repository -> Image (its PATH and files here)
        self.oci_images = dict(oci_images or {})  # repository[:tag] -> OciImage: its containers run under runc
        # Host directories every container in an image sees at their own paths, writable: the node's shared
        # filesystem (as a cluster mounts NFS or a CSI volume in its pods), where tests keep data, models, outputs.
        self.shared_paths = tuple(shared_paths)
        self.lease_duration = lease_duration
        self.node_status_period = node_status_period
        self.ips = ips or IPS
        self.log = logging.getLogger(f"tests.infra.kube.harness.kubelet.{name}")
        self._handler = logging.FileHandler(self.workdir / "kubelet.log")
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(threadName)s %(message)s"))
        self.log.addHandler(self._handler)
        self.log.setLevel(logging.DEBUG)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._workers: dict[str, PodWorker] = {}  # uid -> worker, until the pod is gone
        self._kept: dict[str, PodWorker] = {}  # uid -> worker whose kill is held (hold_kill), gone or not
        self._threads: list[threading.Thread] = []
        self._watch_resp = None
        self.node_uid = None

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> ProcessKubelet:
        self.map_root_user = mount_namespace_mode()  # before the node exists: no pod runs without it
        self._register()
        for target, tname in ((self._heartbeat_loop, "lease"), (self._watch_loop, "watch")):
            t = threading.Thread(target=target, name=f"kubelet-{self.name}-{tname}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop like a crashed node: kill every pod process (no API updates), stop threads."""
        self._stop.set()
        resp = self._watch_resp
        if resp is not None:  # unblock the watch thread's read
            with contextlib.suppress(Exception):
                if hasattr(resp, "shutdown"):
                    resp.shutdown()  # urllib3 >= 2.3
                else:
                    resp.connection.sock.shutdown(2)
        with self._lock:
            workers = list(self._workers.values()) + [w for w in self._kept.values() if w.uid not in self._workers]
            self._kept.clear()
        for w in workers:
            w.release_kill()
            w.kill(report=False)
        for w in workers:
            w.join(timeout)
        for t in self._threads:
            t.join(timeout)
        self.log.removeHandler(self._handler)
        self._handler.close()

    # ---- introspection -----------------------------------------------------------------
    def log_path(self, namespace: str, name: str, container: str | None = None) -> Path | None:
        """Log file of a pod's container (by default ``main`` if it has one, else its first), or None
        if this kubelet never ran it."""
        with self._lock:
            for w in self._workers.values():
                if w.namespace == namespace and w.pod_name == name:
                    if container is None:
                        return w.primary.log_file
                    return next((c.log_file for c in w.inits + w.containers if c.name == container), None)
        hits = log_files(self.workdir, namespace, name, container)
        if container is None:
            hits = [h for h in hits if h.stem == "main"] or hits
        return hits[-1] if hits else None

    def running(self) -> dict[str, int]:
        """``namespace/name`` -> pid of the pod's primary container (``main``, else the first) running now."""
        with self._lock:
            workers = list(self._workers.values())
        return {
            w.ref: w.primary.proc.pid for w in workers if w.primary.proc is not None and w.primary.proc.poll() is None
        }

    def processes(self, namespace: str, name: str) -> set[int]:
        """The host PIDs of every process of the pod ``namespace/name`` running here (none when there is none)."""
        return {pid for w in self._pods() if w.namespace == namespace and w.pod_name == name for pid in w.processes()}

    def exit_codes(self, namespace: str, name: str) -> dict[str, int]:
        """Container name -> exit code, for every container of the pod ``namespace/name`` run here that ended for
        good (as its ``containerStatuses`` say), a deleted pod's whose kill is held included: the API no longer holds
        that one's status."""
        return {
            c.name: c.terminated["exitCode"]
            for w in self._pods()
            if w.namespace == namespace and w.pod_name == name
            for c in w.containers
            if c.terminated is not None
        }

    def freeze(self, namespace: str, name: str) -> set[int]:
        """SIGSTOP every process of the pod ``namespace/name`` (all its containers, whatever their process groups):
        a hung pod the API still calls Running, as this kubelet goes on heartbeating. Deleting it still kills it
        (SIGKILL reaches a stopped process). Returns the stopped host PIDs."""
        return self._pod(namespace, name).freeze()

    def resume(self, namespace: str, name: str) -> set[int]:
        """SIGCONT every process of the pod ``namespace/name``. Returns their host PIDs."""
        return self._pod(namespace, name).resume()

    def hold_kill(self, namespace: str, name: str) -> None:
        """Until release_kill: the pod's deletion (graceful or not, the pod gone from the API or not) is seen and not
        acted upon, so its processes live on, as on a node cut off from the apiserver after its pod was force-deleted:
        the API may then hold its replacement beside them (a zombie, when resumed)."""
        w = self._pod(namespace, name)
        w.hold_kill()
        with self._lock:
            self._kept[w.uid] = w

    def release_kill(self, namespace: str, name: str) -> None:
        """Act upon the pod's held deletion, if any, as the node does once its network returns."""
        with self._lock:
            found = [w for w in self._kept.values() if w.namespace == namespace and w.pod_name == name]
            for w in found:
                del self._kept[w.uid]
        if not found:
            raise LookupError(f"pod {namespace}/{name}: no kill held on node {self.name}")
        for w in found:
            w.release_kill()

    def _pods(self) -> list[PodWorker]:
        """Every pod this kubelet runs: those the API holds, and those deleted there whose kill is held."""
        with self._lock:
            return list(self._workers.values()) + [w for w in self._kept.values() if w.uid not in self._workers]

    def _pod(self, namespace: str, name: str) -> PodWorker:
        found = [w for w in self._pods() if w.namespace == namespace and w.pod_name == name and w.processes()]
        if not found:
            raise LookupError(f"pod {namespace}/{name} has no running process on node {self.name}")
        return found[-1]

    # ---- node and lease ------------------------------------------------------------------
    def _node_status(self) -> dict:
        t = now_iso()

        def cond(type_, status, reason, msg):
            return {
                "type": type_,
                "status": status,
                "reason": reason,
                "message": msg,
                "lastHeartbeatTime": t,
                "lastTransitionTime": t,
            }

        return {
            "capacity": self.capacity,
            "allocatable": self.capacity,
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "process kubelet"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "process kubelet"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "process kubelet"),
                cond("Ready", "True", "KubeletReady", "process kubelet is posting ready status"),
            ],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": self.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {
                "machineID": self.name,
                "systemUUID": self.name,
                "bootID": self.name,
                "kernelVersion": os.uname().release,
                "osImage": "process kubelet",
                "containerRuntimeVersion": "process://1",
                "kubeletVersion": KUBE_VERSION,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }

    def _register(self) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": self.labels},
            "spec": {"taints": self.taints} if self.taints else {},
            "status": self._node_status(),
        }
        try:
            node = self.core.create_node(body)
        except self.ApiException as e:
            if e.status != 409:
                raise
            node = self.core.patch_node(self.name, {"metadata": {"labels": self.labels}})
        self.node_uid = node.metadata.uid
        self.core.patch_node_status(self.name, {"status": self._node_status()})
        self._renew_lease()
        self.log.info("registered node %s (%s)", self.name, self.capacity)

    def _renew_lease(self) -> None:
        spec = {"holderIdentity": self.name, "leaseDurationSeconds": self.lease_duration, "renewTime": now_micro()}
        try:
            self.coord.patch_namespaced_lease(self.name, "kube-node-lease", {"spec": spec})
        except self.ApiException as e:
            if e.status != 404:
                raise
            self.coord.create_namespaced_lease(
                "kube-node-lease",
                {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {
                        "name": self.name,
                        "namespace": "kube-node-lease",
                        "ownerReferences": [
                            {"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": self.node_uid}
                        ],
                    },
                    "spec": spec,
                },
            )

    def _heartbeat_loop(self) -> None:
        last_status = time.monotonic()
        while not self._stop.wait(max(1.0, self.lease_duration / 4)):
            try:
                self._renew_lease()
                if time.monotonic() - last_status > self.node_status_period:
                    self.core.patch_node_status(self.name, {"status": self._node_status()})
                    last_status = time.monotonic()
            except Exception as e:  # noqa: BLE001
                if not self._stop.is_set():
                    self.log.warning("heartbeat failed: %r", e)

    # ---- pods ----------------------------------------------------------------------------
    def _watch_loop(self) -> None:
        from kubernetes.watch.watch import iter_resp_lines

        selector = f"spec.nodeName={self.name}"
        rv = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    resp = self.core.list_pod_for_all_namespaces(field_selector=selector, _preload_content=False)
                    lst = json.loads(resp.data)
                    rv = lst["metadata"]["resourceVersion"]
                    present = set()
                    for pod in lst["items"]:
                        present.add(pod["metadata"]["uid"])
                        self._on_pod(pod)
                    with self._lock:
                        gone = [w for uid, w in self._workers.items() if uid not in present]
                    for w in gone:
                        self._on_gone(w.uid)
                resp = self.core.list_pod_for_all_namespaces(
                    field_selector=selector,
                    watch=True,
                    resource_version=rv,
                    allow_watch_bookmarks=True,
                    timeout_seconds=30,
                    _preload_content=False,
                )
                self._watch_resp = resp
                for line in iter_resp_lines(resp):
                    if self._stop.is_set():
                        break
                    ev = json.loads(line)
                    obj = ev.get("object") or {}
                    if ev.get("type") == "ERROR":
                        if obj.get("code") == 410:
                            self.log.info("watch: 410 Gone, re-listing")
                            rv = None
                        else:
                            self.log.warning("watch error: %s", obj)
                            rv = None
                        break
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    if ev.get("type") == "BOOKMARK":
                        continue
                    if ev.get("type") == "DELETED":
                        self._on_gone(obj["metadata"]["uid"])
                    else:
                        self._on_pod(obj)
            except Exception as e:  # noqa: BLE001
                if self._stop.is_set():
                    break
                if isinstance(e, self.ApiException) and e.status == 410:
                    rv = None
                self.log.warning("watch failed (%r); retrying", e)
                self._stop.wait(1.0)
            finally:
                self._watch_resp = None

    def _on_pod(self, pod: dict) -> None:
        meta, status = pod["metadata"], pod.get("status") or {}
        uid = meta["uid"]
        with self._lock:
            w = self._workers.get(uid)
            if w is None:
                if meta.get("deletionTimestamp") is None and status.get("phase") in TERMINAL:
                    return  # finished before we saw it (e.g. a previous kubelet); nothing to run
                if meta.get("deletionTimestamp") is None:
                    w = PodWorker(self, pod)
                    self._workers[uid] = w
                    w.start()
                    return
        if meta.get("deletionTimestamp") is not None:
            grace = meta.get("deletionGracePeriodSeconds")
            grace = 30 if grace is None else int(grace)
            if w is None or not w.request_delete(grace):
                self.delete_now(meta["namespace"], meta["name"], uid)

    def _on_gone(self, uid: str) -> None:
        with self._lock:
            w = self._workers.pop(uid, None)
        if w is not None:
            w.kill(report=False)

    def delete_now(self, namespace: str, name: str, uid: str) -> None:
        try:
            self.core.delete_namespaced_pod(
                name, namespace, body={"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
            )
            self.log.info("deleted %s/%s (grace 0)", namespace, name)
        except self.ApiException as e:
            if e.status not in (404, 409):
                self.log.warning("delete %s/%s failed: %s", namespace, name, e)
