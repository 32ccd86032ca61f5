"""A *process kubelet*: a test fixture that plays a node's kubelet with local processes.

``ProcessKubelet(api_client, "node-a", cpu="2", memory="4Gi", pods=10).start()``

* registers Node ``node-a`` (capacity = allocatable: cpu, memory, pods; Ready, with the
  usual labels) and renews its Lease in ``kube-node-lease``;
* watches the pods bound to it (``spec.nodeName``; re-lists on 410 Gone) and runs each pod's
  **first container** ``command + args`` (``$(VAR)`` expanded; the image is ignored, so the
  command must be given) as a local process in its own process group, with:

  - the environment of this Python process (``base_env``), then the Kubernetes service
    variables (``KUBERNETES_SERVICE_HOST``/``_PORT`` = the real apiserver), ``HOSTNAME``,
    then the container's ``env``/``envFrom``: literal values, ``fieldRef`` (metadata.name,
    .namespace, .uid, .labels['k'], .annotations['k'], spec.nodeName,
    spec.serviceAccountName, status.podIP, status.hostIP), ``secretKeyRef`` and
    ``configMapKeyRef`` read from the API;
  - ``PROCESS_KUBELET_POD_IP`` (the pod's address) and ``PROCESS_KUBELET_ROOT``: a directory
    standing for the container's filesystem root, where volumes are materialised at
    ``$PROCESS_KUBELET_ROOT/<mountPath>`` (emptyDir, secret, configMap, downwardAPI,
    hostPath as a symlink, and projected ones including the service-account token, so
    ``$PROCESS_KUBELET_ROOT/var/run/secrets/kubernetes.io/serviceaccount/token`` is a real,
    pod-bound token);
  - its own loopback address 127.0.0.N (``status.podIP``; Linux routes all of 127/8 to lo);
  - its own ``/dev/shm``: the process runs in a mount namespace of its own (``unshare --mount``,
    private propagation) where a fresh tmpfs of 64 MiB, mounted as container runtimes mount it, covers
    ``/dev/shm``. As on a real node, pods do not see each other's shared memory (nor the host's),
    so code that passes data through /dev/shm between "hosts" that share a loopback network fails
    here as it would on a cluster, and code that only uses its own /dev/shm (TensorFlow,
    multiprocessing) works. Needs root, or unprivileged user namespaces (then ``--map-root-user``);
    the kubelet checks once and refuses to start without it rather than run pods dishonestly.
    Unlike a real pod's, the tmpfs is per start of the container, not kept across its restarts;
* patches the pod status: Pending (IP, ContainerCreating) -> Running (container
  running/started, Ready) -> Succeeded/Failed with the exit code in
  ``containerStatuses[0].state.terminated`` (restartPolicy Always/OnFailure restart the
  process, counting ``restartCount``);
* honours graceful deletion: when ``deletionTimestamp`` is set, SIGTERM to the process,
  SIGKILL to its process group after ``deletionGracePeriodSeconds``, terminal status, then
  DELETE with grace period 0 (uid precondition) so the pod disappears and e.g. the
  scheduler's preemption completes. A pod deleted outright is killed at once.

Logs: each container's stdout+stderr goes to ``<workdir>/pods/<ns>_<name>_<uid>/<container>.log``
(:meth:`ProcessKubelet.log_path`), the kubelet's own log to ``<workdir>/kubelet.log``.

Several kubelets can run in one process; pod addresses come from one allocator per
process. Not implemented: init containers, containers after the first, probes, lifecycle
hooks, resource enforcement, exec/logs/port-forward through the apiserver, volumes mounted at
their real ``mountPath`` (they live under ``$PROCESS_KUBELET_ROOT``; :func:`in_mount_namespace`
takes bind mounts for when they are).
"""
from __future__ import annotations

import base64
import contextlib
import datetime as _dt
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .controlplane import _die_with_parent

KUBE_VERSION = "v1.34"
TERMINAL = ("Succeeded", "Failed")


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class _IPAllocator:
    """127.0.0.2 ... 127.0.0.254, then 127.0.1.1 ...; round robin so a just-freed address is
    not handed out again at once. One per Python process, shared by all kubelets."""

    def __init__(self, first: int = 2, size: int = 250 * 254):
        self._lock = threading.Lock()
        self._used: set[int] = set()
        self._next = 0
        self._first, self._size = first, size

    @staticmethod
    def _ip(n: int) -> str:
        n += 2  # 127.0.0.2 is n=0
        hi, lo = divmod(n - 1, 254)
        return f"127.0.{hi}.{lo + 1}"

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


IPS = _IPAllocator()

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def expand(s: str, env: dict) -> str:
    """Kubernetes' $(VAR) expansion: $(VAR) -> value when defined, $$ -> $."""
    def sub(m):
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR.sub(sub, s)


# ---- a mount namespace per container ----------------------------------------------------------

# What containerd and Docker mount on a container's /dev/shm unless told otherwise.
DEV_SHM_OPTIONS = "nosuid,nodev,noexec,mode=1777,size=64m"


@dataclass(frozen=True)
class Mount:
    """One mount made inside a container's mount namespace before its command runs: a fresh
    filesystem (``fstype`` "tmpfs", ...) or, with fstype "bind", a directory of the pod's
    (``source``) shown at ``target``."""
    target: str
    fstype: str
    source: str = "none"
    options: str = ""

    def shell(self) -> str:
        q = shlex.quote
        if self.fstype == "bind":
            return f"mount --bind {q(self.source)} {q(self.target)}"
        opts = f" -o {q(self.options)}" if self.options else ""
        return f"mount -t {q(self.fstype)}{opts} {q(self.source)} {q(self.target)}"


def private_dev_shm() -> Mount:
    return Mount("/dev/shm", "tmpfs", "shm", DEV_SHM_OPTIONS)


def in_mount_namespace(argv: list[str], mounts: list[Mount], *, map_root_user: bool = False) -> list[str]:
    """``argv`` wrapped to run in a mount namespace of its own, after ``mounts``.

    Propagation is private, so nothing mounted inside reaches the host's namespace, and the
    mounts go away with the last process in it. The wrapper execs (no fork), so the process the
    kubelet started, signals and waits for is the container's command itself. A failed mount
    fails the container (exit code of mount, message in its log)."""
    script = "set -e\n" + "".join(m.shell() + "\n" for m in mounts) + 'exec "$@"'
    unshare = [_tool("unshare"), "--mount", "--propagation", "private"]
    if map_root_user:
        unshare.append("--map-root-user")
    return [*unshare, "--", _tool("sh"), "-c", script, "container", *argv]


def _tool(name: str) -> str:
    # Absolute: a pod's own PATH must not decide which unshare/sh/mount wraps it.
    path = shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if path is None:
        raise MountNamespaceUnavailable(f"the process kubelet needs {name}(1) to give each pod its own /dev/shm")
    return path


class MountNamespaceUnavailable(RuntimeError):
    """This machine cannot give a pod a mount namespace of its own (not root, no user namespaces)."""


_ns_mode: bool | None = None   # map_root_user, once known
_ns_mode_lock = threading.Lock()


def mount_namespace_mode() -> bool:
    """Whether containers need ``--map-root-user`` (not root, user namespaces allowed): tried
    once per process with a real tmpfs on /dev/shm in a throwaway namespace."""
    global _ns_mode
    with _ns_mode_lock:
        if _ns_mode is None:
            errors = []
            for map_root_user in (False, True):
                argv = in_mount_namespace(["true"], [private_dev_shm()], map_root_user=map_root_user)
                p = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
                if p.returncode == 0:
                    _ns_mode = map_root_user
                    break
                errors.append(f"{shlex.join(argv[:5])}: {p.stderr.strip() or p.returncode}")
            else:
                raise MountNamespaceUnavailable(
                    "the process kubelet gives each pod its own /dev/shm (a mount namespace per pod, as "
                    "a real node has) and cannot here; run as root or allow unprivileged user "
                    "namespaces. Tried: " + "; ".join(errors))
        return _ns_mode


class PodConfigError(Exception):
    """The pod references something missing (secret, key...); retried like the kubelet does."""


class ProcessKubelet:
    def __init__(self, api_client, name: str, *, cpu: str = "4", memory: str = "8Gi", pods: int = 110,
                 labels: dict | None = None, taints: list | None = None, workdir: str | Path | None = None,
                 api_host: str = "127.0.0.1", api_port: int = 443, base_env: dict | None = None,
                 cwd: str | None = None, lease_duration: int = 40, node_status_period: float = 60.0,
                 ips: _IPAllocator | None = None):
        import kubernetes.client

        self.api = api_client
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.coord = kubernetes.client.CoordinationV1Api(api_client)
        self.ApiException = kubernetes.client.ApiException
        self.name = name
        self.capacity = {"cpu": str(cpu), "memory": str(memory), "pods": str(pods),
                         "ephemeral-storage": "100Gi"}
        self.labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                       "kubernetes.io/arch": "amd64", **(labels or {})}
        self.taints = taints or []
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"process-kubelet-{name}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.api_host, self.api_port = api_host, api_port
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.cwd = cwd
        self.lease_duration = lease_duration
        self.node_status_period = node_status_period
        self.ips = ips or IPS
        self.log = logging.getLogger(f"kube.harness.kubelet.{name}")
        self._handler = logging.FileHandler(self.workdir / "kubelet.log")
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(threadName)s %(message)s"))
        self.log.addHandler(self._handler)
        self.log.setLevel(logging.DEBUG)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._workers: dict[str, _PodWorker] = {}  # uid -> worker, until the pod is gone
        self._threads: list[threading.Thread] = []
        self._watch_resp = None
        self.node_uid = None

    # ---- lifecycle -------------------------------------------------------------------
    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def start(self) -> "ProcessKubelet":
        self.map_root_user = mount_namespace_mode()   # before the node exists: no pod runs without it
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
            workers = list(self._workers.values())
        for w in workers:
            w.kill(report=False)
        for w in workers:
            w.join(timeout)
        for t in self._threads:
            t.join(timeout)
        self.log.removeHandler(self._handler)
        self._handler.close()

    # ---- introspection -----------------------------------------------------------------
    def log_path(self, namespace: str, name: str) -> Path | None:
        """Log file of the pod's (first) container, or None if this kubelet never ran it."""
        with self._lock:
            for w in self._workers.values():
                if w.namespace == namespace and w.pod_name == name:
                    return w.log_file
        hits = sorted(self.workdir.glob(f"pods/{namespace}_{name}_*/*.log"), key=lambda p: p.stat().st_mtime)
        return hits[-1] if hits else None

    def running(self) -> dict[str, int]:
        """``namespace/name`` -> pid of the pod processes running now."""
        with self._lock:
            return {f"{w.namespace}/{w.pod_name}": w.proc.pid for w in self._workers.values()
                    if w.proc is not None and w.proc.poll() is None}

    # ---- node and lease ------------------------------------------------------------------
    def _node_status(self) -> dict:
        t = now_iso()

        def cond(type_, status, reason, msg):
            return {"type": type_, "status": status, "reason": reason, "message": msg,
                    "lastHeartbeatTime": t, "lastTransitionTime": t}
        return {
            "capacity": self.capacity, "allocatable": self.capacity,
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "process kubelet"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "process kubelet"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "process kubelet"),
                cond("Ready", "True", "KubeletReady", "process kubelet is posting ready status"),
            ],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": self.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {"machineID": self.name, "systemUUID": self.name, "bootID": self.name,
                         "kernelVersion": os.uname().release, "osImage": "process kubelet",
                         "containerRuntimeVersion": "process://1", "kubeletVersion": KUBE_VERSION,
                         "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64"},
        }

    def _register(self) -> None:
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.name, "labels": self.labels},
                "spec": {"taints": self.taints} if self.taints else {},
                "status": self._node_status()}
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
        spec = {"holderIdentity": self.name, "leaseDurationSeconds": self.lease_duration,
                "renewTime": now_micro()}
        try:
            self.coord.patch_namespaced_lease(self.name, "kube-node-lease", {"spec": spec})
        except self.ApiException as e:
            if e.status != 404:
                raise
            self.coord.create_namespaced_lease("kube-node-lease", {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": "kube-node-lease",
                             "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.name,
                                                  "uid": self.node_uid}]},
                "spec": spec})

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
                    field_selector=selector, watch=True, resource_version=rv, allow_watch_bookmarks=True,
                    timeout_seconds=30, _preload_content=False)
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
                    w = _PodWorker(self, pod)
                    self._workers[uid] = w
                    w.start()
                    return
        if meta.get("deletionTimestamp") is not None:
            grace = meta.get("deletionGracePeriodSeconds")
            grace = 30 if grace is None else int(grace)
            if w is None or not w.request_delete(grace):
                self._delete_now(meta["namespace"], meta["name"], uid)

    def _on_gone(self, uid: str) -> None:
        with self._lock:
            w = self._workers.pop(uid, None)
        if w is not None:
            w.kill(report=False)

    def _delete_now(self, namespace: str, name: str, uid: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, namespace, body={"gracePeriodSeconds": 0,
                                                                   "preconditions": {"uid": uid}})
            self.log.info("deleted %s/%s (grace 0)", namespace, name)
        except self.ApiException as e:
            if e.status not in (404, 409):
                self.log.warning("delete %s/%s failed: %s", namespace, name, e)


class _PodWorker(threading.Thread):
    """Runs one pod: materialises env and volumes, runs the process, reports, deletes."""

    def __init__(self, kubelet: ProcessKubelet, pod: dict):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.k, self.pod = kubelet, pod
        self.uid, self.namespace, self.pod_name = meta["uid"], meta["namespace"], meta["name"]
        self.container = (pod["spec"].get("containers") or [{}])[0]
        self.cname = self.container.get("name", "main")
        self.dir = kubelet.workdir / "pods" / f"{self.namespace}_{self.pod_name}_{self.uid}"
        self.root = self.dir / "fs"
        self.log_file = self.dir / f"{self.cname}.log"
        self.proc: subprocess.Popen | None = None
        self.ip: str | None = None
        self._cv = threading.Condition()
        self._deleting = False
        self._deadline: float | None = None   # SIGKILL at
        self._term_sent = False
        self._report = True
        self._killed = False
        self._delete_sent = False
        self._done = False  # set (under _cv) once deletion requests are no longer acted upon

    # -- called from the watch thread
    def request_delete(self, grace: int) -> bool:
        """False when the worker is past the point of acting on it (caller deletes)."""
        with self._cv:
            if self._done:
                return False
            deadline = time.monotonic() + max(0, grace)
            if self._deadline is None or deadline < self._deadline:
                self._deadline = deadline
            if not self._deleting:
                self.k.log.info("%s/%s: deletion requested, grace %ss", self.namespace, self.pod_name, grace)
            self._deleting = True
            self._cv.notify_all()
            return True

    def kill(self, report: bool) -> None:
        with self._cv:
            self._deleting = True
            self._killed = True
            self._report = report
            self._deadline = time.monotonic()
            self._cv.notify_all()

    # -- the pod's thread
    def run(self) -> None:
        try:
            self._run()
        except Exception:  # noqa: BLE001
            self.k.log.exception("%s/%s: worker failed", self.namespace, self.pod_name)
        finally:
            if self.proc is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            if self.ip:
                self.k.ips.release(self.ip)
            with self._cv:  # a deletion that arrived after _finish looked: act on it here
                self._done = True
                pending = self._deleting and self._report and not self._delete_sent
            if pending:
                self._delete_sent = True
                self.k._delete_now(self.namespace, self.pod_name, self.uid)

    def _run(self) -> None:
        k, spec = self.k, self.pod["spec"]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.root.mkdir(exist_ok=True)
        self.ip = k.ips.allocate()
        self.pod.setdefault("status", {})["podIP"] = self.ip
        self.started_at = now_iso()
        image = self.container.get("image", "")
        self._patch({"phase": "Pending", "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
                     "podIP": self.ip, "podIPs": [{"ip": self.ip}], "startTime": self.started_at,
                     "conditions": [self._cond("PodReadyToStartContainers", "True"),
                                    self._cond("Initialized", "True"),
                                    self._cond("ContainersReady", "False", "ContainersNotReady"),
                                    self._cond("Ready", "False", "ContainersNotReady")],
                     "containerStatuses": [self._cstatus({"waiting": {"reason": "ContainerCreating"}})]})
        k.log.info("%s/%s: pod ip %s", self.namespace, self.pod_name, self.ip)

        # env + volumes; missing secrets/config maps are retried as the kubelet does
        while True:
            try:
                env = self._env()
                self._volumes()
                break
            except PodConfigError as e:
                self._patch({"containerStatuses": [self._cstatus(
                    {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}})]})
                k.log.info("%s/%s: %s; retrying", self.namespace, self.pod_name, e)
                if self._wait_deleting(2.0):
                    return self._finish(None, deleted=True)

        with self._cv:
            if self._deleting:
                return self._finish(None, deleted=True)
        policy = spec.get("restartPolicy", "Always")
        restarts, last_state, code = 0, {}, None
        while True:
            argv = [expand(a, env) for a in (self.container.get("command") or [])] + \
                   [expand(a, env) for a in (self.container.get("args") or [])]
            started = now_iso()
            try:
                if not self.container.get("command"):
                    raise FileNotFoundError("the process kubelet ignores images: the container needs a command")
                # Found before wrapping, so a missing program is a StartError as with a runtime,
                # not the wrapper's exit code 127.
                if shutil.which(argv[0], path=env.get("PATH", os.defpath)) is None:
                    raise FileNotFoundError(f"executable file not found: {argv[0]}")
                with open(self.log_file, "ab") as out:
                    self.proc = subprocess.Popen(
                        in_mount_namespace(argv, self._mounts(), map_root_user=k.map_root_user),
                        env=env, cwd=self._cwd(), stdin=subprocess.DEVNULL, stdout=out,
                        stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
            except OSError as e:
                with open(self.log_file, "ab") as out:
                    out.write(f"[process kubelet] cannot start {argv}: {e}\n".encode())
                k.log.warning("%s/%s: cannot start %s: %s", self.namespace, self.pod_name, argv, e)
                code, reason, message = 128, "StartError", str(e)
            else:
                k.log.info("%s/%s: started pid %d: %s", self.namespace, self.pod_name, self.proc.pid, argv)
                self.container_id = f"process://{self.name_for_id()}/{self.proc.pid}"
                self._patch({"phase": "Running",
                             "conditions": [self._cond("ContainersReady", "True"), self._cond("Ready", "True")],
                             "containerStatuses": [self._cstatus({"running": {"startedAt": started}, "waiting": None,
                                                                  "terminated": None},
                                                                 ready=True, started=True, restarts=restarts,
                                                                 last_state=last_state)]})
                code = self._wait_process()
                reason = "Completed" if code == 0 else "Error"
                message = None
                k.log.info("%s/%s: pid %d exited with %d", self.namespace, self.pod_name, self.proc.pid, code)
            terminated = {"exitCode": code, "reason": reason, "startedAt": started, "finishedAt": now_iso(),
                          "containerID": getattr(self, "container_id", None)}
            if message:
                terminated["message"] = message
            if self.proc is not None and self.proc.returncode is not None and self.proc.returncode < 0:
                terminated["signal"] = -self.proc.returncode
            with self._cv:
                deleting = self._deleting
            restart = not deleting and (policy == "Always" or (policy == "OnFailure" and code != 0))
            if not restart:
                return self._finish(terminated, deleted=deleting, restarts=restarts)
            restarts += 1
            last_state = {"terminated": terminated}
            self._patch({"containerStatuses": [self._cstatus(
                {"waiting": {"reason": "CrashLoopBackOff" if code else "Completed"}, "running": None,
                 "terminated": None}, restarts=restarts, last_state=last_state)]})
            if self._wait_deleting(min(10.0, 0.5 * 2 ** min(restarts, 5))):
                return self._finish(terminated, deleted=True, restarts=restarts)

    def name_for_id(self) -> str:
        return self.k.name

    def _mounts(self) -> list[Mount]:
        """What the container's mount namespace shows that the host's does not: its pod's own
        /dev/shm (a worker cannot map a segment another pod made, as between two hosts)."""
        return [private_dev_shm()]

    def _wait_process(self) -> int:
        """Wait for the process; on deletion SIGTERM it, SIGKILL the group at the deadline."""
        p = self.proc
        while True:
            try:
                rc = p.wait(0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            with self._cv:
                deleting, deadline = self._deleting, self._deadline
            if deleting and not self._term_sent:
                self._term_sent = True
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
                self.k.log.info("%s/%s: SIGTERM pid %d", self.namespace, self.pod_name, p.pid)
            if deleting and deadline is not None and time.monotonic() >= deadline:
                self.k.log.info("%s/%s: grace period over, SIGKILL", self.namespace, self.pod_name)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                rc = p.wait()
                break
        with contextlib.suppress(ProcessLookupError, PermissionError):  # what the container left behind
            os.killpg(p.pid, signal.SIGKILL)
        return 128 - rc if rc < 0 else rc  # -SIG -> 128+SIG, as container runtimes report it

    def _wait_deleting(self, timeout: float) -> bool:
        with self._cv:
            self._cv.wait_for(lambda: self._deleting, timeout)
            return self._deleting

    def _finish(self, terminated: dict | None, deleted: bool, restarts: int = 0) -> None:
        if not self._report:
            return
        if terminated is not None:
            phase = "Succeeded" if terminated["exitCode"] == 0 else "Failed"
            self._patch({"phase": phase,
                         "conditions": [self._cond("ContainersReady", "False", "PodCompleted"),
                                        self._cond("Ready", "False", "PodCompleted")],
                         "containerStatuses": [self._cstatus({"terminated": terminated, "running": None,
                                                              "waiting": None}, restarts=restarts)]})
        elif deleted:
            self._patch({"phase": "Failed", "conditions": [self._cond("Ready", "False", "PodCompleted")]})
        with self._cv:
            self._done = True
            deleted = deleted or self._deleting
        if deleted and self._report:
            self._delete_sent = True
            self.k._delete_now(self.namespace, self.pod_name, self.uid)

    # -- helpers
    def _cwd(self) -> str | None:
        wd = self.container.get("workingDir")
        if wd:
            p = self.root / wd.lstrip("/")
            if p.is_dir():
                return str(p)
            if os.path.isdir(wd):
                return wd
        return self.k.cwd

    def _cond(self, type_: str, status: str, reason: str | None = None) -> dict:
        c = {"type": type_, "status": status, "lastTransitionTime": now_iso(), "lastProbeTime": None}
        if reason:
            c["reason"] = reason
        return c

    def _cstatus(self, state: dict, ready: bool = False, started: bool = False, restarts: int = 0,
                 last_state: dict | None = None) -> dict:
        cs = {"name": self.cname, "image": self.container.get("image", ""), "imageID": "",
              "ready": ready, "started": started, "restartCount": restarts, "state": state,
              "lastState": last_state or {}}
        if getattr(self, "container_id", None):
            cs["containerID"] = self.container_id
        return cs

    def _patch(self, status: dict) -> None:
        if not self._report:
            return
        try:
            self.k.core.patch_namespaced_pod_status(self.pod_name, self.namespace, {"status": status})
        except self.k.ApiException as e:
            if e.status == 404:
                self._report = False
            else:
                self.k.log.warning("%s/%s: status patch failed: %s %s", self.namespace, self.pod_name,
                                   e.status, e.body)

    def _read(self, kind: str, name: str, optional: bool):
        """Secret or ConfigMap data (decoded to str), None if optional and missing."""
        read = self.k.core.read_namespaced_secret if kind == "secret" else self.k.core.read_namespaced_config_map
        deadline = time.monotonic() + 5.0
        while True:
            try:
                obj = read(name, self.namespace, _preload_content=False)
                data = json.loads(obj.data)
                break
            except self.k.ApiException as e:
                # 403 right after binding: the Node authorizer's graph has not seen the pod yet
                if e.status == 403 and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                if e.status == 404 and optional:
                    return None
                raise PodConfigError(f"{kind} {self.namespace}/{name}: {e.status} {e.reason}") from e
        out = {}
        for key, value in (data.get("data") or {}).items():
            out[key] = base64.b64decode(value) if kind == "secret" else value.encode()
        for key, value in (data.get("binaryData") or {}).items():
            out[key] = base64.b64decode(value)
        return out

    def _field(self, path: str) -> str:
        pod, meta = self.pod, self.pod["metadata"]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return (meta.get(m.group(1)) or {}).get(m.group(2), "")
        return {
            "metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
            "spec.nodeName": self.k.name, "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
            "status.podIP": self.ip, "status.podIPs": self.ip, "status.hostIP": "127.0.0.1",
            "status.hostIPs": "127.0.0.1",
        }.get(path, "")

    def _env(self) -> dict:
        k = self.k
        env = dict(k.base_env)
        env.update({"HOSTNAME": self.pod_name,
                    "KUBERNETES_SERVICE_HOST": k.api_host, "KUBERNETES_SERVICE_PORT": str(k.api_port),
                    "KUBERNETES_SERVICE_PORT_HTTPS": str(k.api_port),
                    "KUBERNETES_PORT": f"tcp://{k.api_host}:{k.api_port}",
                    "PROCESS_KUBELET_POD_IP": self.ip, "PROCESS_KUBELET_ROOT": str(self.root)})
        for src in self.container.get("envFrom") or []:
            prefix = src.get("prefix", "")
            for kind, key in (("secret", "secretRef"), ("configmap", "configMapRef")):
                if key in src:
                    data = self._read(kind, src[key]["name"], src[key].get("optional", False)) or {}
                    env.update({prefix + k_: v.decode() for k_, v in data.items()})
        for e in self.container.get("env") or []:
            name = e["name"]
            if "valueFrom" not in e:
                env[name] = expand(e.get("value", ""), env)
                continue
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                env[name] = self._field(vf["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in vf or "configMapKeyRef" in vf:
                kind, ref = ("secret", vf["secretKeyRef"]) if "secretKeyRef" in vf else \
                            ("configmap", vf["configMapKeyRef"])
                data = self._read(kind, ref["name"], ref.get("optional", False))
                if data is None or ref["key"] not in data:
                    if ref.get("optional"):
                        continue
                    raise PodConfigError(f"{kind} {self.namespace}/{ref['name']} has no key {ref['key']}")
                env[name] = data[ref["key"]].decode()
            else:
                k.log.warning("%s/%s: env %s: unsupported valueFrom %s", self.namespace, self.pod_name,
                              name, list(vf))
        return env

    def _volumes(self) -> None:
        vols = {v["name"]: v for v in self.pod["spec"].get("volumes") or []}
        for m in self.container.get("volumeMounts") or []:
            v = vols.get(m["name"])
            if v is None:
                continue
            target = self.root / m["mountPath"].lstrip("/")
            if "hostPath" in v:
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.exists():
                    target.symlink_to(v["hostPath"]["path"])
                continue
            target.mkdir(parents=True, exist_ok=True)
            if "emptyDir" in v:
                continue
            files: dict[str, bytes] = {}
            if "secret" in v:
                files = self._items("secret", v["secret"].get("secretName"), v["secret"])
            elif "configMap" in v:
                files = self._items("configmap", v["configMap"]["name"], v["configMap"])
            elif "downwardAPI" in v:
                files = self._downward(v["downwardAPI"].get("items") or [])
            elif "projected" in v:
                for src in v["projected"].get("sources") or []:
                    if "serviceAccountToken" in src:
                        t = src["serviceAccountToken"]
                        files[t["path"]] = self._token(t.get("audience"), t.get("expirationSeconds", 3600)).encode()
                    elif "secret" in src:
                        files.update(self._items("secret", src["secret"]["name"], src["secret"]))
                    elif "configMap" in src:
                        files.update(self._items("configmap", src["configMap"]["name"], src["configMap"]))
                    elif "downwardAPI" in src:
                        files.update(self._downward(src["downwardAPI"].get("items") or []))
            else:
                self.k.log.warning("%s/%s: volume %s: unsupported type", self.namespace, self.pod_name, m["name"])
            for rel, data in files.items():
                f = target / rel
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_bytes(data)

    def _items(self, kind: str, name: str, src: dict) -> dict[str, bytes]:
        data = self._read(kind, name, src.get("optional", False)) or {}
        if src.get("items"):
            return {it["path"]: data[it["key"]] for it in src["items"] if it["key"] in data}
        return data

    def _downward(self, items: list) -> dict[str, bytes]:
        return {it["path"]: self._field(it["fieldRef"]["fieldPath"]).encode()
                for it in items if "fieldRef" in it}

    def _token(self, audience: str | None, seconds: int) -> str:
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        spec = {"expirationSeconds": max(600, int(seconds)),
                "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": self.pod_name, "uid": self.uid}}
        if audience:
            spec["audiences"] = [audience]
        deadline = time.monotonic() + 5.0
        while True:
            try:
                resp = self.k.core.create_namespaced_service_account_token(
                    sa, self.namespace, {"spec": spec}, _preload_content=False)
                return json.loads(resp.data)["status"]["token"]
            except self.k.ApiException as e:
                if e.status == 403 and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                raise PodConfigError(f"token for service account {self.namespace}/{sa}: {e.status} {e.reason}") from e
