"""The backend itself: `KubernetesBackend`, the Backend contract over the job's pods.

One identity, one process
    A relaunched instance's pod is created only once its predecessor's process has ended
    (terminal phase or gone; forced after the grace period + 15 s), so two processes never speak
    to the master as the same (role, index).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
import threading
import time

from elastic_step.backends.api import ROLES, Backend, EventKind, InstanceEvent, InstanceId, InstanceSpec
from elastic_step.backends.kubernetes import kueue
from elastic_step.backends.kubernetes.adoption import adopt, compatible, launch_number, reown_patch
from elastic_step.backends.kubernetes.config import (
    NAMESPACE_ENV,
    POD_SPEC_ENV,
    Owner,
    load_api_client,
    load_pod_labels,
    load_pod_spec,
    master_host,
    owner_refs,
)
from elastic_step.backends.kubernetes.errors import KubernetesBackendError, KubernetesPermissionError
from elastic_step.backends.kubernetes.events import EventRecorder
from elastic_step.backends.kubernetes.image import container_image, no_step_pod, role_images, step_pod_name
from elastic_step.backends.kubernetes.pending import due, read_workloads, what_holds
from elastic_step.backends.kubernetes.permissions import check_permissions, translate
from elastic_step.backends.kubernetes.pods import (
    _JOB_ID,
    DEFAULT_PRIORITY,
    LABEL_JOB,
    PRIORITY_FILE,
    TERMINAL,
    _Launch,
    _Pod,
    job_labels,
    pod_body,
    track,
)
from elastic_step.backends.kubernetes.secret import ensure_secret
from elastic_step.backends.kubernetes.security import restricted_violations
from elastic_step.backends.kubernetes.settings import PodSettings
from elastic_step.backends.kubernetes.watch import PodWatch, apply_pod, overdue_loss, transition
from elastic_step.errors import ConfigError

log = logging.getLogger("elastic_step.backends.kubernetes")
# How long a replacement waits for its predecessor's Workload to leave the queue once that pod is gone: the garbage
# collector deletes it after its owner, in seconds, unless the cluster is in trouble.
WORKLOAD_WAIT_S = 60


def _check_job_id(job_id: str) -> None:
    if not (len(job_id) <= 50 and _JOB_ID.fullmatch(job_id)):
        raise ConfigError(
            f"The job id {job_id!r} cannot name Kubernetes pods: use at most 50 lowercase "
            "letters, digits and '-', starting and ending with a letter or digit."
        )


class KubernetesBackend(Backend):
    name = "kubernetes"
    shares_files = False  # pods on other nodes: a step's local inputs are served to them

    def __init__(
        self,
        job_id: str,
        token: str,
        *,
        namespace: str | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        api_client=None,
        image: str | None = None,
        owner: Owner | None | str = "env",
        pod_spec: dict | None = None,
        pod_labels: dict | None = None,
        master_ip: str | None = None,
        queue: str = "",
        num_ps: int = 0,
        settings: PodSettings | None = None,
        grace_s: int = 30,
        watch_timeout_s: int = 240,
        pending_report_s: float = 300.0,
        preflight: bool = True,
        reuse_token: bool = True,
    ):
        super().__init__()
        import kubernetes

        _check_job_id(job_id)
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
        self.owner = Owner.from_env() if owner == "env" else owner
        self.pod_spec = load_pod_spec(pod_spec)
        self.pod_labels = load_pod_labels(pod_labels)
        self.master_ip = master_ip or master_host(in_cluster)
        self.queue, self.num_ps = queue, int(num_ps)
        self.settings = settings or PodSettings()
        if settings:
            log.info("job %s pods: %s", job_id, self.settings.describe())
        self.grace_s = int(grace_s)
        self.watch_timeout_s = int(watch_timeout_s)
        self.pending_report_s = float(pending_report_s)
        self.selector = f"{LABEL_JOB}={job_id}"
        self.secret_name = f"{job_id}-token"
        self._lock = threading.Lock()
        self._pods: dict[str, _Pod] = {}
        self._launches: dict[InstanceId, _Launch] = {}
        self._numbers: dict[InstanceId, int] = {}
        self._default_priority = dict(DEFAULT_PRIORITY)
        self._closed = threading.Event()
        # What the master tells the platform: Events on the step's pod (none without one to regard).
        self._recorder = (
            EventRecorder(kubernetes.client.EventsV1Api(api_client), self.namespace, self.owner, self.owner.name)
            if self.owner
            else None
        )
        self._preflight(preflight, image, in_cluster)
        self.token, self.token_reused = ensure_secret(
            self._call,
            self.core,
            self.secret_name,
            self.namespace,
            labels=job_labels(job_id),
            owner_refs=owner_refs(self.owner),
            token=token,
            reuse=reuse_token,
        )
        self._take_over_and_watch()

    def _preflight(self, permissions: bool, image: str | None, in_cluster: bool) -> None:
        """Before the backend creates anything: its permissions (unless told not to), the roles' images, the pods'
        security, and the Kueue queue it is given."""
        if permissions:
            check_permissions(
                self.k8s,
                self.api,
                self.namespace,
                self._call,
                kueue.NEEDED if self.queue else (),
                kueue.WANTED if self.queue else None,
            )
        step_pod = self.owner.name if self.owner else step_pod_name(in_cluster)
        self.images = role_images(
            image,
            lambda: self._step_image(step_pod),
            {role: self.settings.role(role).accelerators for role in ROLES},
        )
        self._check_pod_security()
        if self.queue:
            kueue.check_local_queue(self.k8s.CustomObjectsApi(self.api), self.namespace, self.queue, self._call)

    def _take_over_and_watch(self) -> None:
        """The job's pods a previous master left: adopted, or deleted when they cannot be; then the watch, from the
        adoption's listing, and the report of pods held pending."""
        listing = self._list()
        self._adoptable, leftovers = adopt(listing["items"], self._pods, self._numbers, self.job_id)
        for name in leftovers:
            self._delete(name, 0)
        self.adopted = dict(self._adoptable)
        # The watch resumes from the adoption's listing: nothing between the two goes unseen.
        self._watch = PodWatch(
            self.core,
            self.namespace,
            self.selector,
            self.job_id,
            timeout_s=self.watch_timeout_s,
            rv=listing["metadata"]["resourceVersion"],
            closed=self._closed,
            lock=self._lock,
            pods=self._pods,
            list_pods=self._list,
            on_pod=self._on_pod,
        )
        self._watcher = threading.Thread(target=self._watch.run, name=f"k8s-watch-{self.job_id}", daemon=True)
        self._watcher.start()
        self._workloads = read_workloads(self.k8s.CustomObjectsApi(self.api), self.namespace, self._call)
        if self.pending_report_s > 0:
            threading.Thread(target=self._report_pending, name=f"k8s-pending-{self.job_id}", daemon=True).start()

    @classmethod
    def from_train_config(cls, cfg, job_id: str, token: str, **kwargs) -> KubernetesBackend:
        """The backend of `cfg` (namespace, credentials, owner, pod spec from the environment) for the job
        `job_id` with a new `token`. A restarted master reuses the job's Secret: `backend.token` is then
        the stored token, which the job's plan takes (master/plan.py)."""
        return cls(
            job_id,
            token,
            image=cfg.worker_image or None,
            queue=cfg.queue,
            pending_report_s=cfg.pending_report,
            num_ps=cfg.num_ps,
            settings=PodSettings.from_train_config(cfg),
            **kwargs,
        )

    @property
    def stats(self) -> dict[str, int]:
        """The watch's counters: relists, 410 Gone answers, watch requests, pod versions watched."""
        return self._watch.stats

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
            raise translate(e, verb, resource, self.namespace) from None
        except urllib3.exceptions.HTTPError as e:
            reason = str(getattr(e, "reason", None) or e)
            reason = (re.search(r"\[Errno -?\d+\][^\"')]*", reason) or [reason])[0]
            raise KubernetesBackendError(
                f"Cannot reach the Kubernetes API server at {self.api.configuration.host} ({verb} {resource}: "
                f"{reason}). Check that KUBECONFIG, or the service account of the step's pod, points at a "
                "running cluster that this process can reach, or use --backend local."
            ) from None

    def _step_image(self, pod_name: str | None) -> str:
        """The image of the step's own pod (image.py)."""
        if not pod_name:
            raise no_step_pod()
        r = self._call(
            "get", "pods", self.core.read_namespaced_pod, pod_name, self.namespace, ok=(404,), _preload_content=False
        )
        if r is None:
            raise ConfigError(
                f"worker_image is not set and the step's pod {pod_name} (whose image the workers and parameter servers "
                f"run by default) is not in namespace {self.namespace}: set worker_image to their image, or run the "
                "step in that namespace."
            )
        image = container_image(json.loads(r.data))
        log.info("job %s: workers and parameter servers run the step's image %s (pod %s)", self.job_id, image, pod_name)
        return image

    # ---------------------------------------------------------------- listing
    def _list(self) -> dict:
        r = self._call(
            "list",
            "pods",
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=self.selector,
            _preload_content=False,
        )
        return json.loads(r.data)

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
            keep = pod is not None and pod.live and compatible(pod, spec, self.token_reused)
            if keep:
                launch = _Launch(
                    spec,
                    launch_number(self._pods, pod.name),
                    name=pod.name,
                    adopted=True,
                    state="running" if pod.phase == "Running" else "pending",
                    pending_since=time.monotonic(),
                )
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
            # A queued pod's replacement waits until its predecessor and its Workload have left the API (kueue.py).
            launch.blocked_until_gone = kueue.replaces_once_gone(self.queue)
            blockers = [
                p
                for p in self._pods.values()
                if p.inst == inst and not (p.gone if launch.blocked_until_gone else p.process_over)
            ]
            if blockers:
                launch.blocker = blockers[0].name
            elif launch.blocked_until_gone and cur is not None and cur.name:
                launch.blocker = cur.name  # gone already, and its Workload perhaps not
            else:
                launch.state = "creating"
            self._launches[inst] = launch
        if launch.blocker:
            if blockers:
                launch.timer = threading.Timer(self.grace_s + 15, self._unblock, args=(launch,))
                launch.timer.daemon = True
                launch.timer.start()
            until = "left the API" if launch.blocked_until_gone else "terminated"
            self.emit(
                InstanceEvent(
                    EventKind.STARTED,
                    inst,
                    detail=f"{replaced}its pod is created once pod {launch.blocker} has {until}",
                )
            )
            if not blockers:
                self._create_deferred(launch)
            return
        try:
            self._create(launch)
        except Exception:
            with self._lock:
                launch.end()
            raise
        self._created(launch, f"{replaced}pod {launch.name}")

    def stop(self, instance: InstanceId, grace_s: float = 10.0) -> None:
        """Graceful: the pod's process gets SIGTERM (a worker finishes and reports its minibatch)
        and EXITED comes with its exit code. Waits until it ended (grace + 15 s at most)."""
        launch = self._mark_ending(
            instance,
            "stopping",
            InstanceEvent(EventKind.EXITED, instance, exit_code=0, detail="stopped before its pod existed"),
        )
        if launch is None:
            return
        grace = max(1, math.ceil(grace_s))
        self._delete(launch.name, grace)
        launch.ended.wait(grace + 15)

    def kill(self, instance: InstanceId) -> None:
        launch = self._mark_ending(
            instance, "killing", InstanceEvent(EventKind.LOST, instance, detail="killed before its pod existed")
        )
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
                launch.end()
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

    def tell(self, reason: str, note: str, action: str, warning: bool = False) -> None:
        if self._recorder is not None:
            self._recorder.record(reason, note, action, warning)

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
        deadline = time.monotonic() + grace + 15  # then grace 0 for what is left
        give_up = deadline + 15
        forced: set[str] = set()
        try:
            while True:
                items = self._list()["items"]
                if not items:
                    break
                now = time.monotonic()
                if now > give_up:
                    log.warning(
                        "job %s: %d pod(s) still there after close: %s",
                        self.job_id,
                        len(items),
                        ", ".join(o["metadata"]["name"] for o in items),
                    )
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
            self._watch.wake()
            try:
                self._call(
                    "delete", "secrets", self.core.delete_namespaced_secret, self.secret_name, self.namespace, ok=(404,)
                )
            except Exception as e:  # noqa: BLE001
                log.error("job %s: could not delete the Secret %s: %s", self.job_id, self.secret_name, e)
            self._watcher.join(5)
            if self._recorder is not None:
                self._recorder.close()  # the last Events, before the client goes
            with contextlib.suppress(Exception):
                self.api.close()

    def abandon(self) -> None:
        """Stop watching without deleting anything: what a crashed master leaves (tests)."""
        self._closed.set()
        self._watch.wake()
        self._watcher.join(5)

    # ---------------------------------------------------------------- pods
    def _body(self, launch: _Launch) -> dict:
        return pod_body(
            launch,
            job_id=self.job_id,
            namespace=self.namespace,
            image=self.images[launch.spec.id.role],
            secret_name=self.secret_name,
            grace_s=self.grace_s,
            pod_spec=self.pod_spec,
            default_priority=self._default_priority.get(launch.spec.id.role),
            owner_refs=owner_refs(self.owner),
            pod_labels=self.pod_labels,
            queue=self.queue,
            num_ps=self.num_ps,
            settings=self.settings,
        )

    def _check_pod_security(self) -> None:
        """The pods the job would create, checked against the restricted Pod Security level (security.py) before
        any exists: what breaks it came from ELASTIC_STEP_POD_SPEC or the pod settings."""
        for role in ROLES:
            launch = _Launch(InstanceSpec(InstanceId(role, 0), ["elastic-step"]), 1, name=f"{self.job_id}-{role}-0")
            broken = restricted_violations(self._body(launch)["spec"])
            if broken:
                raise ConfigError(
                    f"The {role} pods would break the restricted Pod Security Standard, which many namespaces enforce: "
                    f"{'; '.join(broken)}. The backend's pods pass it; remove what {POD_SPEC_ENV} or the pod "
                    "settings (volumes) change there."
                )

    def _create(self, launch: _Launch) -> None:
        inst = launch.spec.id
        for _ in range(10):
            name = f"{self.job_id}-{inst.role}-{inst.index}"
            if launch.number > 1:
                name += f"-{launch.number}"
            with self._lock:
                launch.name = name
            body = self._body(launch)
            try:
                r = self._call(
                    "create",
                    "pods",
                    self.core.create_namespaced_pod,
                    self.namespace,
                    body,
                    ok=(409,),
                    _preload_content=False,
                )
            except KubernetesPermissionError:
                raise
            except KubernetesBackendError as err:
                default = self._default_priority.get(inst.role)
                if (
                    err.status == 403
                    and not launch.spec.priority_class
                    and default
                    and f"no PriorityClass with name {default}" in str(err)
                ):
                    log.warning(
                        "PriorityClass %s does not exist: %s pods get the namespace's default priority "
                        "(apply %s to change that)",
                        default,
                        inst.role,
                        PRIORITY_FILE,
                    )
                    self._default_priority[inst.role] = None
                    continue
                if "PriorityClass" in str(err):
                    raise KubernetesBackendError(
                        f"{err} (create it, e.g. from {PRIORITY_FILE}, or pass another "
                        "--worker-priority-class / --ps-priority-class)",
                        err.status,
                    ) from None
                raise
            if r is None:  # 409: a pod of a previous master holds the name
                with self._lock:
                    launch.number = self._numbers[inst] = max(self._numbers.get(inst, 0), launch.number) + 1
                continue
            created = json.loads(r.data)
            with self._lock:
                track(self._pods, created)
            log.info("created pod %s for %s", name, inst)
            return
        raise KubernetesBackendError(
            f"Could not find a free pod name for {inst} of job {self.job_id} in namespace "
            f"{self.namespace} after 10 tries: delete the job's leftover pods (label "
            f"{self.selector}) or use another --job-id."
        )

    def _delete(self, name: str, grace: int) -> None:
        with self._lock:
            pod = self._pods.get(name)
            if pod is not None and grace == 0:
                pod.forced = True
        self._call(
            "delete",
            "pods",
            self.core.delete_namespaced_pod,
            name,
            self.namespace,
            ok=(404,),
            grace_period_seconds=grace,
            _preload_content=False,
        )

    def _reown(self, pod: _Pod) -> None:
        ops = reown_patch(pod, owner_refs(self.owner))
        if ops is None:
            return
        self._call(
            "patch",
            "pods",
            self.core.patch_namespaced_pod,
            pod.name,
            self.namespace,
            ops,
            ok=(404, 422),
            _preload_content=False,
        )

    def _unblock(self, launch: _Launch) -> None:
        """The predecessor outlived its grace period (e.g. its node is gone): force it."""
        with self._lock:
            if launch.state != "deferred" or self._closed.is_set() or launch.blocker not in self._pods:
                return  # created meanwhile, or the predecessor left and its Workload is being waited for
            blocker = launch.blocker
        log.warning("pod %s still there %ds after its deletion; deleting it with grace 0", blocker, self.grace_s + 15)
        with contextlib.suppress(Exception):
            self._delete(blocker, 0)
        self._create_deferred(launch)

    def _create_deferred(self, launch: _Launch) -> None:
        if self._queued_predecessor(launch):
            return
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
                launch.end()
            self.emit(InstanceEvent(EventKind.LOST, launch.spec.id, detail=f"could not create its pod: {e}"))
            return
        self._created(launch, None)

    def _queued_predecessor(self, launch: _Launch) -> bool:
        """Whether the predecessor's Workload is still in the queue (its pod gone): the replacement then waits for
        it, checked again every second, for WORKLOAD_WAIT_S at most (kueue.replaces_once_gone says why)."""
        if not (launch.blocked_until_gone and launch.blocker) or self._closed.is_set():
            return False
        workloads = self._workloads()
        wl = kueue.owned_workload(workloads, name=launch.blocker) if workloads is not None else None
        if wl is None:
            return False
        now, name = time.monotonic(), wl["metadata"]["name"]
        with self._lock:
            if launch.state != "deferred" or self._launches.get(launch.spec.id) is not launch:
                return True
            first = launch.workload_deadline is None
            if first:
                launch.workload_deadline = now + WORKLOAD_WAIT_S
            overdue = now >= launch.workload_deadline
        if overdue:
            log.warning(
                "Kueue's Workload %s of pod %s is still there %ds after its pod left: creating the pod of %s anyway",
                name,
                launch.blocker,
                WORKLOAD_WAIT_S,
                launch.spec.id,
            )
            return False
        if first:
            log.info(
                "the pod of %s is created once Kueue's Workload %s of its predecessor %s has left the queue "
                "(Kueue would admit that one first)",
                launch.spec.id,
                name,
                launch.blocker,
            )
        timer = threading.Timer(1.0, self._create_deferred, args=(launch,))
        timer.daemon = True
        timer.start()
        return True

    def _created(self, launch: _Launch, started: str | None) -> None:
        """After the create call: STARTED (unless already said), then whatever the watch saw meanwhile."""
        with self._lock:
            launch.state = "pending"
            launch.pending_since = time.monotonic()
            pod = self._pods.get(launch.name)
            if pod is None:  # deleted before the create call even returned
                launch.end()
                event = InstanceEvent(EventKind.LOST, launch.spec.id, detail=f"pod {launch.name} deleted")
            else:
                event = transition(launch, pod, self.grace_s, self._lost_after_grace)
        if started is not None:
            self.emit(InstanceEvent(EventKind.STARTED, launch.spec.id, detail=started))
        if event is not None:
            self.emit(event)

    # ---------------------------------------------------------------- watch
    def _on_pod(self, obj: dict, deleted: bool) -> None:
        with self._lock:
            event, ready = apply_pod(self._pods, self._launches, obj, deleted, self.grace_s, self._lost_after_grace)
        if event is not None:
            self.emit(event)
        for launch in ready:
            self._create_deferred(launch)

    def _report_pending(self) -> None:
        """The pending-pod reporter's thread: a launch still pending past each multiple of the bound is reported
        (WAITING) with what holds its pod: Kueue's Workload and condition, or the scheduler's reason."""
        period = max(0.5, min(5.0, self.pending_report_s / 4))
        while not self._closed.wait(period):
            now = time.monotonic()
            with self._lock:
                waiting = [
                    (l, self._pods[l.name].obj)
                    for l in self._launches.values()
                    if l.state == "pending"
                    and l.pending_since is not None
                    and l.name in self._pods
                    and not self._pods[l.name].deleting
                    and due(now - l.pending_since, l.waits_reported, self.pending_report_s)
                ]
                for launch, _ in waiting:
                    launch.waits_reported += 1
            workloads = functools.cache(self._workloads)  # one listing a round, read only if a pod is gated
            for launch, obj in waiting:
                waited = now - launch.pending_since
                detail = f"pod {launch.name} pending for {waited:.0f}s: {what_holds(obj, workloads)}"
                self.emit(InstanceEvent(EventKind.WAITING, launch.spec.id, detail=detail))

    def _lost_after_grace(self, launch: _Launch, name: str) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            event = overdue_loss(launch, name, self._pods)
        if event is not None:
            self.emit(event)
