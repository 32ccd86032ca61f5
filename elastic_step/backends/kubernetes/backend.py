"""Kubernetes backend: every instance is a pod in the step's namespace.

    backend = KubernetesBackend.from_train_config(cfg)   # what `--backend kubernetes` does

Pods
    `<job>-<role>-<index>` (a relaunch: `<job>-<role>-<index>-<launch>`), labels `elastic-step/job`,
    `elastic-step/role`, `elastic-step/index`, `elastic-step/launch` and
    `app.kubernetes.io/managed-by: elastic-step`; command = the instance's argv; the job token from
    the Secret `<job>-token` (`secretKeyRef`, never a literal), `ELASTIC_STEP_POD_IP` from the
    downward API (`status.podIP`: a PS serves and advertises on it); requests = limits = the
    instance's cpu/memory; `priorityClassName` (default `elastic-low` for workers, `elastic-high`
    for PS, when the cluster has them: see manifests/priorityclasses.yaml); restartPolicy Never;
    no service-account token; terminationGracePeriodSeconds 30; an ownerReference
    (blockOwnerDeletion false) to the step's pod: `KFP_POD_NAME`/`KFP_POD_UID`, else the master's
    own pod (`POD_NAME`/`POD_UID` from the downward API), else none. `ELASTIC_STEP_POD_SPEC`
    (JSON) is merged into every pod's spec: nodeSelector, tolerations, affinity, imagePullSecrets...

Events
    One watch on the job's pods (label selector), resumed from the last resourceVersion and
    re-listed on 410 Gone (the re-list reconciles what the watch missed). RUNNING when the pod
    runs; EXITED with the container's exit code when it ends by itself (or after the master's
    graceful `stop`); LOST when a pod deleted from outside (preemption by the scheduler, eviction,
    the garbage collector, kubectl) has ended: its deletionTimestamp is set, its process gets
    SIGTERM, a worker finishes and reports its minibatch and exits, and the loss is reported then
    (within a second, typically), with the cause ("preempted by the scheduler") and exit code. Not
    earlier: the master relaunches a lost instance at once, and the old process, still in its grace
    period, must not speak for the new one (it could take a lease nobody would ever release). A
    deleted pod that never ran is lost at once; one whose end is never reported (dead node) after
    its grace period + 10 s. `kill` (grace 0) is LOST at once. Pending pods stay pending: the
    scheduler starts them when room frees.

One identity, one process
    A relaunched instance's pod is created only once its predecessor's process has ended
    (terminal phase or gone; forced after the grace period + 15 s), so two processes never speak
    to the master as the same (role, index).

Restart (adoption)
    On construction the backend lists the job's pods. Live ones (Pending/Running, not deleting)
    are *adopted*: when the master starts that instance again, no second pod is created. An
    adopted pod whose command is exactly the new one (same master address, same token: the
    Secret's token is reused, see `from_train_config`) is kept and re-owned (ownerReference
    patched to the new step pod). Otherwise (the usual case: a restarted step is a new pod with a
    new IP, and the master listens on a fresh port) the old instance's master connection is
    dead: its argv points at the old master, which no longer exists, so it can never register
    again (left alone, a PS stops after ~10 s of failed heartbeats, a worker after its RPCs have
    retried for 60 s). Such a pod is deleted at once (grace 0) and its replacement created in
    its place; the new master restores the shards and the ledger from the job's last checkpoint
    (master/checkpoint.py). Finished pods of the old master are deleted.

Permissions
    The backend checks the verbs it needs (SelfSubjectAccessReview) when it is constructed and
    turns any 403 into a `KubernetesPermissionError` naming the verb, the resource and the Role
    to fix (manifests/role.yaml). It needs only that namespaced Role.
"""
from __future__ import annotations

import base64
import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import pathlib
import re
import socket
import threading
import time

from elastic_step import __version__
from elastic_step.backends.api import (Backend, BackendError, EventKind, InstanceEvent, InstanceId,
                                       InstanceSpec)
from elastic_step.errors import ConfigError, ElasticStepError
from elastic_step.instance import TOKEN_ENV

log = logging.getLogger("elastic_step.backends.kubernetes")

DEFAULT_IMAGE = f"ghcr.io/elastic-step/elastic-step:{__version__}"
MANIFESTS = pathlib.Path(__file__).resolve().parent.parent / "manifests"  # backends/manifests
ROLE_FILE = "elastic_step/backends/manifests/role.yaml"
PRIORITY_FILE = "elastic_step/backends/manifests/priorityclasses.yaml"

LABEL_JOB = "elastic-step/job"
LABEL_ROLE = "elastic-step/role"
LABEL_INDEX = "elastic-step/index"
LABEL_LAUNCH = "elastic-step/launch"
MANAGED_BY = ("app.kubernetes.io/managed-by", "elastic-step")
TOKEN_KEY = "token"
POD_IP_ENV = "ELASTIC_STEP_POD_IP"
POD_SPEC_ENV = "ELASTIC_STEP_POD_SPEC"
NAMESPACE_ENV = "ELASTIC_STEP_NAMESPACE"
DEFAULT_PRIORITY = {"worker": "elastic-low", "ps": "elastic-high"}
TERMINAL = ("Succeeded", "Failed")
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

# Everything the backend does, and so everything the Role must grant (no more).
NEEDED = (("create", "pods"), ("get", "pods"), ("list", "pods"), ("watch", "pods"), ("delete", "pods"),
          ("patch", "pods"), ("create", "secrets"), ("get", "secrets"), ("delete", "secrets"))

_JOB_ID = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class KubernetesBackendError(BackendError, ElasticStepError):
    """The cluster refused or failed a request; the message names it and the fix. `status`: the
    API's HTTP status (None: the API server could not be reached)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class KubernetesPermissionError(KubernetesBackendError):
    """The step's service account lacks a verb on a resource (RBAC 403)."""


def permission_error(missing: list[tuple[str, str]], namespace: str, who: str = "") -> KubernetesPermissionError:
    who = who or "the service account"
    if who.startswith("system:serviceaccount:"):
        who = f"the service account {who}"
    elif not who.startswith("the "):
        who = f"the user {who}"
    what = ", ".join(f"{v} {r}" for v, r in missing)
    fix = ", ".join(f"'{v}' on '{r}'" for v, r in missing)
    return KubernetesPermissionError(
        f"{who} cannot {what} in namespace {namespace}: add {fix} to its Role (see {ROLE_FILE}).", 403)


def load_manifests(name: str, namespace: str | None = None) -> list[dict]:
    """The documents of manifests/<name>.yaml (role, priorityclasses), namespaced if asked."""
    import yaml

    docs = [d for d in yaml.safe_load_all((MANIFESTS / f"{name}.yaml").read_text()) if d]
    if namespace:
        for d in docs:
            if d["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
                d["metadata"]["namespace"] = namespace
            for s in d.get("subjects") or []:
                if s.get("kind") == "ServiceAccount":
                    s["namespace"] = namespace
    return docs


# ------------------------------------------------------------------------------ configuration

@dataclasses.dataclass(frozen=True)
class Owner:
    """The pod that owns the job's pods and Secret (deleting it deletes them)."""
    name: str
    uid: str

    def ref(self) -> dict:
        return {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid,
                "controller": False, "blockOwnerDeletion": False}

    @classmethod
    def from_env(cls, env=None) -> "Owner | None":
        env = os.environ if env is None else env
        for n, u in (("KFP_POD_NAME", "KFP_POD_UID"), ("POD_NAME", "POD_UID")):
            if env.get(n) and env.get(u):
                return cls(env[n], env[u])
        return None


def _sa_root() -> str:
    # The test control plane's process kubelet materialises volumes under this prefix.
    return os.environ.get("PROCESS_KUBELET_ROOT", "")


def _in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.isfile(_sa_root() + SA_DIR + "/token")


def load_api_client(kubeconfig: str | None = None, context: str | None = None):
    """(ApiClient, namespace or None, in_cluster): an explicit kubeconfig, else $KUBECONFIG, else
    the pod's service account, else ~/.kube/config."""
    import kubernetes

    kubeconfig = kubeconfig or os.environ.get("KUBECONFIG") or None
    if kubeconfig is None and _in_cluster():
        root = _sa_root()
        cfg = kubernetes.client.Configuration()
        kubernetes.config.incluster_config.InClusterConfigLoader(
            token_filename=root + kubernetes.config.incluster_config.SERVICE_TOKEN_FILENAME,
            cert_filename=root + kubernetes.config.incluster_config.SERVICE_CERT_FILENAME,
        ).load_and_set(cfg)
        ns = None
        with contextlib.suppress(OSError):
            ns = pathlib.Path(root + SA_DIR + "/namespace").read_text().strip() or None
        return kubernetes.client.ApiClient(cfg), ns, True
    path = os.path.expanduser(kubeconfig or "~/.kube/config")
    if not os.path.isfile(path):
        raise KubernetesBackendError(
            f"--backend kubernetes found no Kubernetes credentials: the kubeconfig {path} does not exist and "
            "this process does not run in a pod (no service-account token). Set KUBECONFIG, run the step in "
            "the cluster, or use --backend local (subprocesses).")
    try:
        client = kubernetes.config.new_client_from_config(config_file=path, context=context, persist_config=False)
        contexts, current = kubernetes.config.list_kube_config_contexts(path)
    except kubernetes.config.ConfigException as e:
        raise KubernetesBackendError(f"Cannot use the kubeconfig {path}: {e}") from None
    if context:
        current = next((c for c in contexts if c.get("name") == context), current)
    ns = ((current or {}).get("context") or {}).get("namespace")
    return client, ns, False


def master_host(in_cluster: bool) -> str:
    """The address workers reach the master at: its pod IP (downward API), else (in a pod) the
    address of its hostname, else loopback (the test control plane's process kubelets)."""
    for var in (POD_IP_ENV, "POD_IP"):
        if os.environ.get(var):
            return os.environ[var]
    if in_cluster:
        with contextlib.suppress(OSError):
            return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


# ------------------------------------------------------------------------------ state

@dataclasses.dataclass
class _Pod:
    """What the watch knows of one pod of the job."""
    name: str
    inst: InstanceId
    uid: str = ""
    obj: dict = dataclasses.field(default_factory=dict)
    phase: str | None = None
    deleting: bool = False
    gone: bool = False
    forced: bool = False              # deleted with grace 0 by us: its process is killed
    tracked_at: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def process_over(self) -> bool:
        return self.gone or self.forced or self.phase in TERMINAL

    @property
    def live(self) -> bool:
        return not self.deleting and not self.gone and self.phase not in TERMINAL


@dataclasses.dataclass
class _Launch:
    """One launch of an instance: the pod the master currently counts as that instance."""
    spec: InstanceSpec
    number: int
    name: str = ""
    state: str = "deferred"           # deferred -> pending -> running -> ended
    blocker: str = ""                 # predecessor pod whose process must end first
    stopping: bool = False            # we deleted it gracefully (scale-in): EXITED with its code
    killing: bool = False             # we deleted it with grace 0: LOST
    adopted: bool = False
    ended: threading.Event = dataclasses.field(default_factory=threading.Event)
    timer: threading.Timer | None = None        # forces a deferred creation
    loss_timer: threading.Timer | None = None   # bounds the wait for a deleted pod's end


def _terminated(obj: dict) -> dict | None:
    for cs in (obj.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            return term
    return None


def _deletion_cause(obj: dict) -> str:
    name = obj["metadata"]["name"]
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            if c.get("reason") == "PreemptionByScheduler":
                return f"preempted by the scheduler (pod {name} deleted)"
            return f"pod {name} deleted: {c.get('reason')}: {c.get('message', '')}".rstrip(": ")
    return f"pod {name} deleted from outside the master"


# ------------------------------------------------------------------------------ the backend

class KubernetesBackend(Backend):
    def __init__(self, job_id: str, token: str, *, namespace: str | None = None, kubeconfig: str | None = None,
                 context: str | None = None, api_client=None, image: str | None = None,
                 owner: Owner | None | str = "env", pod_spec: dict | None = None, master_ip: str | None = None,
                 grace_s: int = 30, watch_timeout_s: int = 240, preflight: bool = True,
                 reuse_token: bool = True):
        super().__init__()
        import kubernetes

        if not (len(job_id) <= 50 and _JOB_ID.fullmatch(job_id)):
            raise ConfigError(f"The job id {job_id!r} cannot name Kubernetes pods: use at most 50 lowercase "
                              "letters, digits and '-', starting and ending with a letter or digit.")
        self.k8s = kubernetes.client
        self.ApiException = kubernetes.client.ApiException
        self.job_id = job_id
        in_cluster = False
        if api_client is None:
            api_client, ns_hint, in_cluster = load_api_client(kubeconfig, context)
        else:
            ns_hint = None
        self.api = api_client
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.namespace = namespace or os.environ.get(NAMESPACE_ENV) or ns_hint or "default"
        self.image = image or DEFAULT_IMAGE
        self.owner = Owner.from_env() if owner == "env" else owner
        spec_env = os.environ.get(POD_SPEC_ENV)
        try:
            self.pod_spec = pod_spec if pod_spec is not None else json.loads(spec_env) if spec_env else {}
        except ValueError as e:
            raise ConfigError(f"{POD_SPEC_ENV} is not valid JSON ({e}): give a JSON object of pod spec fields, "
                              'e.g. {"nodeSelector": {"pool": "training"}}.') from None
        if not isinstance(self.pod_spec, dict):
            raise ConfigError(f"{POD_SPEC_ENV} must be a JSON object of pod spec fields, e.g. "
                              '{"nodeSelector": {"pool": "training"}}, not ' + type(self.pod_spec).__name__ + ".")
        self.pod_spec = dict(self.pod_spec)
        if "containers" in self.pod_spec:
            raise ConfigError(f"{POD_SPEC_ENV} may not set containers: the backend builds the container.")
        self.master_ip = master_ip or master_host(in_cluster)
        self.grace_s = int(grace_s)
        self.watch_timeout_s = int(watch_timeout_s)
        self.selector = f"{LABEL_JOB}={job_id}"
        self.secret_name = f"{job_id}-token"
        self.stats = {"relists": 0, "gone_410": 0, "watches": 0}
        self._lock = threading.Lock()
        self._pods: dict[str, _Pod] = {}
        self._launches: dict[InstanceId, _Launch] = {}
        self._numbers: dict[InstanceId, int] = {}
        self._adoptable: dict[InstanceId, str] = {}
        self._default_priority = dict(DEFAULT_PRIORITY)
        self._closed = threading.Event()
        self._rv: str | None = None
        self._resp = None
        self._hold = threading.Event()        # test hooks: hold the watch, resume from a stale version
        self._held = threading.Event()
        self._stale_rv: str | None = None
        self._who = ""

        if preflight:
            self._preflight()
        self.token, self.token_reused = self._ensure_secret(token, reuse_token)
        self._adopt()
        self.adopted = dict(self._adoptable)
        self._watcher = threading.Thread(target=self._watch_loop, name=f"k8s-watch-{job_id}", daemon=True)
        self._watcher.start()

    @classmethod
    def from_train_config(cls, cfg, **kwargs) -> "KubernetesBackend":
        """The backend of `cfg` (namespace, credentials, owner, pod spec from the environment).
        A restarted master reuses the job's Secret, so `cfg.token` becomes the stored token."""
        backend = cls(cfg.job_id, cfg.token, image=cfg.image, **kwargs)
        cfg.token = backend.token
        return backend

    # ---------------------------------------------------------------- API helpers
    def _call(self, verb: str, resource: str, fn, *args, ok: tuple[int, ...] = (), **kwargs):
        """One API call; 403 -> KubernetesPermissionError naming the verb; statuses in `ok` -> None;
        an unreachable API server -> KubernetesBackendError naming it."""
        import urllib3

        try:
            return fn(*args, **kwargs)
        except self.ApiException as e:
            if e.status in ok:
                return None
            raise self._translate(e, verb, resource) from None
        except urllib3.exceptions.HTTPError as e:
            reason = str(getattr(e, "reason", None) or e)
            reason = (re.search(r"\[Errno -?\d+\][^\"')]*", reason) or [reason])[0]
            raise KubernetesBackendError(
                f"Cannot reach the Kubernetes API server at {self.api.configuration.host} ({verb} {resource}: "
                f"{reason}). Check that KUBECONFIG, or the service account of the step's pod, points at a "
                "running cluster that this process can reach, or use --backend local.") from None

    def _translate(self, e, verb: str, resource: str) -> Exception:
        try:
            message = json.loads(e.body).get("message", "") if e.body else ""
        except (ValueError, AttributeError):
            message = str(e.body or e.reason)
        if e.status == 403:
            m = re.search(r'User "([^"]+)" cannot (\w+) resource "([^"]+)"', message)
            if m:
                return permission_error([(m.group(2), m.group(3))], self.namespace, m.group(1))
            return KubernetesBackendError(f"{verb} {resource} in namespace {self.namespace} was refused: {message}",
                                          403)
        if e.status == 401:
            return KubernetesBackendError(f"The Kubernetes API rejected the step's credentials (401 {message}): give "
                                          "it a valid token (the step's service account, or KUBECONFIG).", 401)
        if e.status == 404 and re.search(r'namespaces? "[^"]+" not found', message):
            return KubernetesBackendError(f"The namespace {self.namespace} does not exist: create it, or set "
                                          f"{NAMESPACE_ENV} to the namespace the step runs in.", 404)
        return KubernetesBackendError(f"{verb} {resource} in namespace {self.namespace} failed "
                                      f"({e.status} {e.reason}): {message}", e.status)

    def _preflight(self) -> None:
        """Fail before anything is created when the Role lacks a verb (not after training, when
        the pods could not be deleted)."""
        auth = self.k8s.AuthorizationV1Api(self.api)
        missing = []
        for verb, resource in NEEDED:
            body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                    "spec": {"resourceAttributes": {"namespace": self.namespace, "verb": verb,
                                                    "resource": resource, "group": ""}}}
            try:
                r = self._call("create", "selfsubjectaccessreviews", auth.create_self_subject_access_review, body,
                               _preload_content=False)
            except KubernetesPermissionError:
                raise
            except KubernetesBackendError as e:
                if e.status in (None, 401):  # unreachable, bad credentials: nothing else would work
                    raise
                log.warning("cannot check permissions (%s); relying on the API's answers", e)
                return
            if not json.loads(r.data).get("status", {}).get("allowed"):
                missing.append((verb, resource))
        if missing:
            with contextlib.suppress(Exception):
                r = self.k8s.AuthenticationV1Api(self.api).create_self_subject_review(
                    {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}, _preload_content=False)
                self._who = json.loads(r.data)["status"]["userInfo"]["username"]
            raise permission_error(missing, self.namespace, self._who)

    def _owner_refs(self) -> list[dict]:
        return [self.owner.ref()] if self.owner else []

    def _labels(self, inst: InstanceId | None = None, number: int | None = None) -> dict:
        labels = {LABEL_JOB: self.job_id, MANAGED_BY[0]: MANAGED_BY[1]}
        if inst is not None:
            labels.update({LABEL_ROLE: inst.role, LABEL_INDEX: str(inst.index)})
        if number is not None:
            labels[LABEL_LAUNCH] = str(number)
        return labels

    # ---------------------------------------------------------------- the job's Secret
    def _ensure_secret(self, token: str, reuse: bool) -> tuple[str, bool]:
        """Create `<job>-token`; a restarted master finds it and (by default) keeps its token."""
        r = self._call("get", "secrets", self.core.read_namespaced_secret, self.secret_name, self.namespace,
                       ok=(404,), _preload_content=False)
        stored = None
        if r is not None:
            s = json.loads(r.data)
            stored = base64.b64decode((s.get("data") or {}).get(TOKEN_KEY, "")).decode()
            owners = [o.get("uid") for o in s["metadata"].get("ownerReferences") or []]
            keep = stored if reuse and stored else token
            if keep == stored and owners == [o["uid"] for o in self._owner_refs()]:
                return stored, True
            # A new owner (a retried step) or a new token: re-create it, so the old owner's deletion
            # does not take it away (no 'patch' on secrets needed).
            self._call("delete", "secrets", self.core.delete_namespaced_secret, self.secret_name, self.namespace,
                       ok=(404,))
            token = keep
        body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": self.secret_name, "labels": self._labels(),
                             "ownerReferences": self._owner_refs()},
                "stringData": {TOKEN_KEY: token}}
        for _ in range(20):  # a deleted Secret may take a moment to go
            if self._call("create", "secrets", self.core.create_namespaced_secret, self.namespace, body, ok=(409,)):
                break
            time.sleep(0.1)
        else:
            raise KubernetesBackendError(f"the Secret {self.secret_name} in namespace {self.namespace} is still "
                                         "being deleted; retry the step")
        return token, token == stored

    # ---------------------------------------------------------------- adoption
    def _list(self) -> dict:
        r = self._call("list", "pods", self.core.list_namespaced_pod, self.namespace, label_selector=self.selector,
                       _preload_content=False)
        return json.loads(r.data)

    def _adopt(self) -> None:
        lst = self._list()
        self._rv = lst["metadata"]["resourceVersion"]
        leftovers = []
        for obj in lst["items"]:
            pod = self._track(obj)
            if pod is None:
                continue
            inst = pod.inst
            with contextlib.suppress(ValueError, KeyError):
                n = int(obj["metadata"]["labels"].get(LABEL_LAUNCH, "1"))
                self._numbers[inst] = max(self._numbers.get(inst, 0), n)
            if pod.live:
                other = self._adoptable.get(inst)
                if other is not None:  # two live pods of one instance: keep the latest launch
                    older, pod_name = sorted([other, pod.name], key=self._launch_number)
                    leftovers.append(older)
                    self._adoptable[inst] = pod_name
                else:
                    self._adoptable[inst] = pod.name
            elif pod.phase in TERMINAL and not pod.deleting:
                leftovers.append(pod.name)
        if self._adoptable or leftovers:
            log.info("job %s: adopting %d live pod(s) of a previous master (%s); deleting %d finished one(s)",
                     self.job_id, len(self._adoptable), ", ".join(sorted(self._adoptable.values())), len(leftovers))
        for name in leftovers:
            self._delete(name, 0)

    def _launch_number(self, name: str) -> int:
        with contextlib.suppress(KeyError, ValueError):
            return int(self._pods[name].obj["metadata"]["labels"][LABEL_LAUNCH])
        return 0

    def _track(self, obj: dict) -> _Pod | None:
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        try:
            inst = InstanceId(labels[LABEL_ROLE], int(labels[LABEL_INDEX]))
        except (KeyError, ValueError, ConfigError):
            return None
        pod = self._pods.get(meta["name"])
        if pod is None or (pod.uid and meta.get("uid") and pod.uid != meta["uid"]):
            pod = self._pods[meta["name"]] = _Pod(meta["name"], inst)
        pod.uid = meta.get("uid", pod.uid)
        pod.obj = obj
        pod.phase = (obj.get("status") or {}).get("phase")
        pod.deleting = pod.deleting or meta.get("deletionTimestamp") is not None
        return pod

    def _compatible(self, pod: _Pod, spec: InstanceSpec) -> bool:
        containers = (pod.obj.get("spec") or {}).get("containers") or [{}]
        return self.token_reused and containers[0].get("command") == list(spec.argv)

    # ---------------------------------------------------------------- Backend contract
    def start(self, spec: InstanceSpec) -> None:
        if self._closed.is_set():
            raise KubernetesBackendError("the Kubernetes backend is closed")
        inst = spec.id
        replaced = ""
        with self._lock:
            cur = self._launches.get(inst)
            if cur is not None and cur.state != "ended":
                raise KubernetesBackendError(f"{inst} is already running (pod {cur.name or '(to be created)'})")
            adopted = self._adoptable.pop(inst, None)
            pod = self._pods.get(adopted) if adopted else None
            keep = pod is not None and pod.live and self._compatible(pod, spec)
            if keep:
                launch = _Launch(spec, self._launch_number(pod.name), name=pod.name, adopted=True,
                                 state="running" if pod.phase == "Running" else "pending")
                self._launches[inst] = launch
        if keep:
            self._reown(pod)
            self.emit(InstanceEvent(EventKind.STARTED, inst, detail=f"adopted pod {pod.name}"))
            if launch.state == "running":
                self.emit(InstanceEvent(EventKind.RUNNING, inst, detail=f"adopted pod {pod.name} runs"))
            return
        if pod is not None and not pod.process_over:
            # Its argv points at the previous master, which is gone: it can never rejoin.
            self._delete(pod.name, 0)
            replaced = f"replaces adopted pod {pod.name} (its master is gone); "
        with self._lock:
            n = self._numbers.get(inst, 0) + 1
            self._numbers[inst] = n
            launch = _Launch(spec, n)
            blockers = [p.name for p in self._pods.values() if p.inst == inst and not p.process_over]
            if blockers:
                launch.blocker = blockers[0]
            else:
                launch.state = "creating"
            self._launches[inst] = launch
        if launch.blocker:
            launch.timer = threading.Timer(self.grace_s + 15, self._unblock, args=(launch,))
            launch.timer.daemon = True
            launch.timer.start()
            self.emit(InstanceEvent(EventKind.STARTED, inst, detail=f"{replaced}its pod is created once pod "
                                    f"{launch.blocker} has terminated"))
            return
        try:
            self._create(launch)
        except Exception:
            with self._lock:
                self._end(launch)
            raise
        self._created(launch, f"{replaced}pod {launch.name}")

    def stop(self, instance: InstanceId, grace_s: float = 10.0) -> None:
        """Graceful: the pod's process gets SIGTERM (a worker finishes and reports its minibatch)
        and EXITED comes with its exit code. Waits until it ended (grace + 15 s at most)."""
        launch = self._mark_ending(instance, "stopping", InstanceEvent(
            EventKind.EXITED, instance, exit_code=0, detail="stopped before its pod existed"))
        if launch is None:
            return
        grace = max(1, math.ceil(grace_s))
        self._delete(launch.name, grace)
        launch.ended.wait(grace + 15)

    def kill(self, instance: InstanceId) -> None:
        launch = self._mark_ending(instance, "killing", InstanceEvent(
            EventKind.LOST, instance, detail="killed before its pod existed"))
        if launch is not None:
            self._delete(launch.name, 0)

    def _mark_ending(self, instance: InstanceId, flag: str, if_deferred: InstanceEvent) -> _Launch | None:
        """The launch whose pod `stop`/`kill` deletes, marked `flag` (how its end is reported); None
        when there is no pod to delete: ended already, or deferred (then it ends here, `if_deferred`)."""
        with self._lock:
            launch = self._launches.get(instance)
            if launch is None or launch.state == "ended":
                return None
            if launch.state == "deferred":
                self._end(launch)
                self.emit(if_deferred)
                return None
            setattr(launch, flag, True)
            return launch

    def alive(self) -> set[InstanceId]:
        with self._lock:
            return {i for i, l in self._launches.items() if l.state != "ended"}

    def master_address(self, port: int) -> str:
        host = f"[{self.master_ip}]" if ":" in self.master_ip else self.master_ip
        return f"{host}:{port}"

    def pod_name(self, instance: InstanceId) -> str | None:
        with self._lock:
            launch = self._launches.get(instance)
            return launch.name if launch else None

    def pods(self) -> list[dict]:
        """The job's pods as the API has them now."""
        return self._list()["items"]

    def close(self, grace_s: float = 10.0) -> None:
        """The master's end (and SIGTERM path): delete every pod of the job, wait until they are
        gone, stop watching, delete the token Secret."""
        if self._closed.is_set():
            return
        grace = max(1, math.ceil(grace_s))
        with self._lock:
            for launch in self._launches.values():
                launch.stopping = True
                if launch.timer:
                    launch.timer.cancel()
        deadline = time.monotonic() + grace + 15   # then grace 0 for what is left
        give_up = deadline + 15
        forced: set[str] = set()
        try:
            while True:
                items = self._list()["items"]
                if not items:
                    break
                now = time.monotonic()
                if now > give_up:
                    log.warning("job %s: %d pod(s) still there after close: %s", self.job_id, len(items),
                                ", ".join(o["metadata"]["name"] for o in items))
                    break
                for obj in items:
                    meta, phase = obj["metadata"], (obj.get("status") or {}).get("phase")
                    if phase in TERMINAL or now > deadline or not (obj.get("spec") or {}).get("nodeName"):
                        if meta["uid"] not in forced:
                            forced.add(meta["uid"])
                            self._delete(meta["name"], 0)
                    elif meta.get("deletionTimestamp") is None:
                        self._delete(meta["name"], grace)
                time.sleep(0.3)
        except Exception as e:  # noqa: BLE001 - runs in the master's `finally`: never mask the job's outcome
            log.error("job %s: could not delete its pods (%s); their owner's deletion will", self.job_id, e)
        finally:
            self._closed.set()
            self._wake_watch()
            try:
                self._call("delete", "secrets", self.core.delete_namespaced_secret, self.secret_name,
                           self.namespace, ok=(404,))
            except Exception as e:  # noqa: BLE001
                log.error("job %s: could not delete the Secret %s: %s", self.job_id, self.secret_name, e)
            self._watcher.join(5)
            with contextlib.suppress(Exception):
                self.api.close()

    def abandon(self) -> None:
        """Stop watching without deleting anything: what a crashed master leaves (tests)."""
        self._closed.set()
        self._wake_watch()
        self._watcher.join(5)

    # ---------------------------------------------------------------- pods
    def _pod_body(self, launch: _Launch) -> dict:
        spec, inst = launch.spec, launch.spec.id
        env = [{"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": self.secret_name, "key": TOKEN_KEY}}},
               {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
               {"name": "ELASTIC_STEP_JOB_ID", "value": self.job_id}]
        env += [{"name": k, "value": v} for k, v in spec.env.items() if k not in (TOKEN_ENV, POD_IP_ENV)]
        quantities = {k: v for k, v in (("cpu", spec.cpu), ("memory", spec.memory)) if v}
        container = {"name": inst.role, "image": self.image, "imagePullPolicy": "IfNotPresent",
                     "command": list(spec.argv), "env": env}
        if quantities:
            container["resources"] = {"requests": dict(quantities), "limits": dict(quantities)}
        pod_spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": self.grace_s,
                    "automountServiceAccountToken": False, "enableServiceLinks": False,
                    **copy.deepcopy(self.pod_spec), "containers": [container]}
        priority = spec.priority_class or self._default_priority.get(inst.role)
        if priority:
            pod_spec["priorityClassName"] = priority
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": launch.name, "namespace": self.namespace,
                             "labels": self._labels(inst, launch.number),
                             "ownerReferences": self._owner_refs()},
                "spec": pod_spec}

    def _create(self, launch: _Launch) -> None:
        inst = launch.spec.id
        for _ in range(10):
            name = f"{self.job_id}-{inst.role}-{inst.index}"
            if launch.number > 1:
                name += f"-{launch.number}"
            with self._lock:
                launch.name = name
            body = self._pod_body(launch)
            try:
                r = self._call("create", "pods", self.core.create_namespaced_pod, self.namespace, body, ok=(409,),
                               _preload_content=False)
            except KubernetesPermissionError:
                raise
            except KubernetesBackendError as err:
                default = self._default_priority.get(inst.role)
                if (err.status == 403 and not launch.spec.priority_class and default
                        and f"no PriorityClass with name {default}" in str(err)):
                    log.warning("PriorityClass %s does not exist: %s pods get the namespace's default priority "
                                "(apply %s to change that)", default, inst.role, PRIORITY_FILE)
                    self._default_priority[inst.role] = None
                    continue
                if "PriorityClass" in str(err):
                    raise KubernetesBackendError(f"{err} (create it, e.g. from {PRIORITY_FILE}, or pass another "
                                                 "--worker-priority-class / --ps-priority-class)",
                                                 err.status) from None
                raise
            if r is None:  # 409: a pod of a previous master holds the name
                with self._lock:
                    launch.number = self._numbers[inst] = max(self._numbers.get(inst, 0), launch.number) + 1
                continue
            created = json.loads(r.data)
            with self._lock:
                self._track(created)
            log.info("created pod %s for %s", name, inst)
            return
        raise KubernetesBackendError(f"Could not find a free pod name for {inst} of job {self.job_id} in namespace "
                                     f"{self.namespace} after 10 tries: delete the job's leftover pods (label "
                                     f"{self.selector}) or use another --job-id.")

    def _delete(self, name: str, grace: int) -> None:
        with self._lock:
            pod = self._pods.get(name)
            if pod is not None and grace == 0:
                pod.forced = True
        self._call("delete", "pods", self.core.delete_namespaced_pod, name, self.namespace, ok=(404,),
                   grace_period_seconds=grace, _preload_content=False)

    def _reown(self, pod: _Pod) -> None:
        refs = self._owner_refs()
        if [o.get("uid") for o in pod.obj["metadata"].get("ownerReferences") or []] == [o["uid"] for o in refs]:
            return
        # A JSON patch replaces the list (a strategic merge would add to it, keyed by uid).
        ops = [{"op": "add", "path": "/metadata/ownerReferences", "value": refs}] if refs else \
            [{"op": "remove", "path": "/metadata/ownerReferences"}]
        self._call("patch", "pods", self.core.patch_namespaced_pod, pod.name, self.namespace, ops, ok=(404, 422),
                   _preload_content=False)

    def _unblock(self, launch: _Launch) -> None:
        """The predecessor outlived its grace period (e.g. its node is gone): force it."""
        with self._lock:
            if launch.state != "deferred" or self._closed.is_set():
                return
            blocker = launch.blocker
        log.warning("pod %s still there %ds after its deletion; deleting it with grace 0", blocker, self.grace_s + 15)
        with contextlib.suppress(Exception):
            self._delete(blocker, 0)
        self._create_deferred(launch)

    def _create_deferred(self, launch: _Launch) -> None:
        with self._lock:
            current = self._launches.get(launch.spec.id) is launch
            if launch.state != "deferred" or not current or self._closed.is_set():
                return
            launch.state = "creating"
        if launch.timer:
            launch.timer.cancel()
        try:
            self._create(launch)
        except Exception as e:  # noqa: BLE001 - the master hears of it as a loss and decides
            log.error("could not create the pod of %s: %s", launch.spec.id, e)
            with self._lock:
                self._end(launch)
            self.emit(InstanceEvent(EventKind.LOST, launch.spec.id, detail=f"could not create its pod: {e}"))
            return
        self._created(launch, None)

    def _created(self, launch: _Launch, started: str | None) -> None:
        """After the create call: STARTED (unless already said), then whatever the watch saw meanwhile."""
        with self._lock:
            launch.state = "pending"
            pod = self._pods.get(launch.name)
            if pod is None:  # deleted before the create call even returned
                self._end(launch)
                event = InstanceEvent(EventKind.LOST, launch.spec.id, detail=f"pod {launch.name} deleted")
            else:
                event = self._transition(launch, pod)
        if started is not None:
            self.emit(InstanceEvent(EventKind.STARTED, launch.spec.id, detail=started))
        if event is not None:
            self.emit(event)

    def _end(self, launch: _Launch) -> None:
        launch.state = "ended"
        launch.ended.set()
        for timer in (launch.timer, launch.loss_timer):
            if timer:
                timer.cancel()

    # ---------------------------------------------------------------- watch
    def _on_pod(self, obj: dict, deleted: bool) -> None:
        ready: list[_Launch] = []
        event = None
        with self._lock:
            pod = self._pods.get((obj.get("metadata") or {}).get("name", ""))
            if deleted and pod is None:
                return
            pod = self._track(obj)
            if pod is None:
                return
            if deleted:
                pod.gone = True
            launch = self._launches.get(pod.inst)
            if launch is not None and launch.name == pod.name and launch.state in ("pending", "running"):
                event = self._transition(launch, pod)
            if pod.process_over:
                ready = [l for l in self._launches.values() if l.state == "deferred" and l.blocker == pod.name]
            if pod.gone:
                del self._pods[pod.name]
        if event is not None:
            self.emit(event)
        for launch in ready:
            self._create_deferred(launch)

    def _transition(self, launch: _Launch, pod: _Pod) -> InstanceEvent | None:
        """The event (if any) that this version of the launch's pod means; called under the lock."""
        inst, obj = pod.inst, pod.obj
        external = pod.deleting and not (launch.stopping or launch.killing)
        scheduled = bool((obj.get("spec") or {}).get("nodeName"))
        if pod.phase in TERMINAL or pod.gone or (external and not scheduled):
            self._end(launch)
            term = _terminated(obj) if pod.phase in TERMINAL else None
            code = None if term is None else term.get("exitCode")
            if external:
                return InstanceEvent(EventKind.LOST, inst, exit_code=code, detail=_deletion_cause(obj))
            if pod.phase in TERMINAL:
                if code is None:
                    status = obj.get("status") or {}
                    why = ": ".join(x for x in (status.get("reason"), status.get("message")) if x)
                    return InstanceEvent(EventKind.LOST, inst,
                                         detail=f"pod {pod.name} {pod.phase}" + (f" ({why})" if why else ""))
                if pod.deleting and code >= 128:
                    return InstanceEvent(EventKind.LOST, inst, exit_code=code,
                                         detail=f"killed by signal {code - 128} (pod {pod.name} deleted)")
                return InstanceEvent(EventKind.EXITED, inst, exit_code=code)
            if launch.stopping and not scheduled:
                return InstanceEvent(EventKind.EXITED, inst, exit_code=0,
                                     detail=f"pod {pod.name} stopped before it ran")
            return InstanceEvent(EventKind.LOST, inst, detail=f"killed (pod {pod.name} deleted with grace 0)"
                                 if launch.killing else f"pod {pod.name} deleted")
        if external:
            # Deleted from outside (preemption, eviction, the garbage collector) while its process may
            # still run: it gets SIGTERM, finishes and reports its minibatch, exits, and *then* is
            # lost. Reporting the loss earlier would let the master relaunch the instance while the
            # old process still speaks for it (and may take a lease nobody would ever release).
            # Bounded: a node that never reports the end (e.g. it died) costs grace + 10 s.
            if launch.loss_timer is None:
                grace = (obj.get("metadata") or {}).get("deletionGracePeriodSeconds")
                launch.loss_timer = threading.Timer((self.grace_s if grace is None else int(grace)) + 10,
                                                    self._lost_after_grace, args=(launch, pod.name))
                launch.loss_timer.daemon = True
                launch.loss_timer.start()
            return None
        if pod.phase == "Running" and launch.state == "pending":
            launch.state = "running"
            status = obj.get("status") or {}
            return InstanceEvent(EventKind.RUNNING, inst, detail=f"pod {pod.name} on {obj['spec'].get('nodeName')} "
                                                                 f"at {status.get('podIP')}")
        return None

    def _lost_after_grace(self, launch: _Launch, name: str) -> None:
        with self._lock:
            if launch.state == "ended" or launch.name != name or self._closed.is_set():
                return
            self._end(launch)
            pod = self._pods.get(name)
            cause = _deletion_cause(pod.obj) if pod is not None else f"pod {name} deleted"
        self.emit(InstanceEvent(EventKind.LOST, launch.spec.id,
                                detail=f"{cause}; its end was not reported within its grace period"))

    def _relist(self) -> None:
        t0 = time.monotonic()
        lst = self._list()  # a consistent read: it has every pod created before it started
        names = {o["metadata"]["name"] for o in lst["items"]}
        for obj in lst["items"]:
            self._on_pod(obj, deleted=False)
        with self._lock:
            missed = [p.obj for n, p in self._pods.items() if n not in names and p.obj and p.tracked_at < t0]
        for obj in missed:  # deleted while we were not watching
            self._on_pod(obj, deleted=True)
        self._rv = lst["metadata"]["resourceVersion"]
        self.stats["relists"] += 1

    def _wake_watch(self) -> None:
        resp = self._resp
        if resp is not None:
            with contextlib.suppress(Exception):
                resp.shutdown() if hasattr(resp, "shutdown") else resp.connection.sock.shutdown(2)
            with contextlib.suppress(Exception):
                resp.close()

    def _watch_loop(self) -> None:
        from kubernetes.watch.watch import iter_resp_lines

        while not self._closed.is_set():
            if self._hold.is_set():
                self._held.set()
                while self._hold.is_set() and not self._closed.is_set():
                    time.sleep(0.05)
                self._held.clear()
                if self._stale_rv is not None:
                    self._rv, self._stale_rv = self._stale_rv, None
                continue
            try:
                if self._rv is None:
                    self._relist()
                self.stats["watches"] += 1
                resp = self.core.list_namespaced_pod(
                    self.namespace, label_selector=self.selector, watch=True, resource_version=self._rv,
                    allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout_s, _preload_content=False,
                    _request_timeout=(10, self.watch_timeout_s + 30))
                self._resp = resp
                try:
                    for line in iter_resp_lines(resp):
                        if self._closed.is_set() or self._hold.is_set():
                            break
                        ev = json.loads(line)
                        kind, obj = ev.get("type"), ev.get("object") or {}
                        if kind == "ERROR":
                            if obj.get("code") == 410:
                                self.stats["gone_410"] += 1
                                log.info("watch of job %s: 410 Gone (%s); re-listing", self.job_id,
                                         obj.get("message"))
                            else:
                                log.warning("watch of job %s: error %s; re-listing", self.job_id, obj)
                            self._rv = None
                            break
                        self._rv = (obj.get("metadata") or {}).get("resourceVersion") or self._rv
                        if kind == "BOOKMARK":
                            continue
                        self._on_pod(obj, deleted=kind == "DELETED")
                finally:
                    self._resp = None
                    with contextlib.suppress(Exception):
                        resp.release_conn()
            except self.ApiException as e:
                if e.status == 410:
                    self.stats["gone_410"] += 1
                    log.info("watch of job %s: 410 Gone; re-listing", self.job_id)
                    self._rv = None
                    continue
                if not self._closed.is_set():
                    log.warning("watch of job %s failed: %s", self.job_id, self._translate(e, "watch", "pods"))
                    self._closed.wait(1.0)
            except Exception as e:  # noqa: BLE001 - connection trouble: resume from the last version
                if not self._closed.is_set() and not self._hold.is_set():
                    log.warning("watch of job %s interrupted (%r); resuming", self.job_id, e)
                    self._closed.wait(0.5)

    # test hooks --------------------------------------------------------------
    def _hold_watch(self) -> None:
        """Stop watching (events happen unseen) until `_resume_watch`."""
        self._hold.set()
        self._wake_watch()
        if not self._held.wait(10):
            raise RuntimeError("the watch did not pause")

    def _resume_watch(self, resource_version: str | None = None) -> None:
        """Resume, from `resource_version` if given (e.g. one long compacted: 410 Gone)."""
        self._stale_rv = resource_version
        self._hold.clear()

