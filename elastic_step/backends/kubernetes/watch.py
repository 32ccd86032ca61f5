"""Events: what the job's pods do, as instance events.

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

`apply_pod`, `transition` and `overdue_loss` decide what a pod's state means (under the backend's
lock); `PodWatch` streams the pod versions to the backend.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable

from elastic_step import fault_hooks as faults
from elastic_step.backends.api import EventKind, InstanceEvent, InstanceId
from elastic_step.backends.kubernetes.permissions import translate
from elastic_step.backends.kubernetes.pods import TERMINAL, _deletion_cause, _Launch, _Pod, _terminated, track

log = logging.getLogger("elastic_step.backends.kubernetes")

Overdue = Callable[[_Launch, str], None]  # called when a pod deleted from outside outlives its grace period


def apply_pod(
    pods: dict[str, _Pod], launches: dict[InstanceId, _Launch], obj: dict, deleted: bool, grace_s: int, overdue: Overdue
) -> tuple[InstanceEvent | None, list[_Launch]]:
    """Record this version of a pod (called under the lock): (the event it means for its launch,
    if any; the deferred launches its ended process unblocks)."""
    ready: list[_Launch] = []
    event = None
    pod = pods.get((obj.get("metadata") or {}).get("name", ""))
    if deleted and pod is None:
        return None, ready
    pod = track(pods, obj)
    if pod is None:
        return None, ready
    if deleted:
        pod.gone = True
    launch = launches.get(pod.inst)
    if launch is not None and launch.name == pod.name and launch.state in ("pending", "running"):
        event = transition(launch, pod, grace_s, overdue)
    if pod.process_over:
        ready = [
            l
            for l in launches.values()
            if l.state == "deferred" and l.blocker == pod.name and (pod.gone or not l.blocked_until_gone)
        ]
    if pod.gone:
        del pods[pod.name]
    return event, ready


def transition(launch: _Launch, pod: _Pod, grace_s: int, overdue: Overdue) -> InstanceEvent | None:
    """The event (if any) that this version of the launch's pod means; called under the lock."""
    inst, obj = pod.inst, pod.obj
    external = pod.deleting and not (launch.stopping or launch.killing)
    scheduled = bool((obj.get("spec") or {}).get("nodeName"))
    if pod.phase in TERMINAL or pod.gone or (external and not scheduled):
        launch.end()
        term = _terminated(obj) if pod.phase in TERMINAL else None
        code = None if term is None else term.get("exitCode")
        if external:
            return InstanceEvent(EventKind.LOST, inst, exit_code=code, detail=_deletion_cause(obj))
        if pod.phase in TERMINAL:
            if code is None:
                status = obj.get("status") or {}
                why = ": ".join(x for x in (status.get("reason"), status.get("message")) if x)
                return InstanceEvent(
                    EventKind.LOST, inst, detail=f"pod {pod.name} {pod.phase}" + (f" ({why})" if why else "")
                )
            if pod.deleting and code >= 128:
                return InstanceEvent(
                    EventKind.LOST,
                    inst,
                    exit_code=code,
                    detail=f"killed by signal {code - 128} (pod {pod.name} deleted)",
                )
            return InstanceEvent(EventKind.EXITED, inst, exit_code=code)
        if launch.stopping and not scheduled:
            return InstanceEvent(EventKind.EXITED, inst, exit_code=0, detail=f"pod {pod.name} stopped before it ran")
        return InstanceEvent(
            EventKind.LOST,
            inst,
            detail=f"killed (pod {pod.name} deleted with grace 0)" if launch.killing else f"pod {pod.name} deleted",
        )
    if external:
        # Deleted from outside (preemption, eviction, the garbage collector) while its process may
        # still run: it gets SIGTERM, finishes and reports its minibatch, exits, and *then* is
        # lost. Reporting the loss earlier would let the master relaunch the instance while the
        # old process still speaks for it (and may take a lease nobody would ever release).
        # Bounded: a node that never reports the end (e.g. it died) costs grace + 10 s.
        if launch.loss_timer is None:
            grace = (obj.get("metadata") or {}).get("deletionGracePeriodSeconds")
            launch.loss_timer = threading.Timer(
                (grace_s if grace is None else int(grace)) + 10, overdue, args=(launch, pod.name)
            )
            launch.loss_timer.daemon = True
            launch.loss_timer.start()
        return None
    if pod.phase == "Running" and launch.state == "pending":
        launch.state = "running"
        status = obj.get("status") or {}
        return InstanceEvent(
            EventKind.RUNNING, inst, detail=f"pod {pod.name} on {obj['spec'].get('nodeName')} at {status.get('podIP')}"
        )
    return None


def overdue_loss(launch: _Launch, name: str, pods: dict[str, _Pod]) -> InstanceEvent | None:
    """The loss of `launch` whose pod `name` was deleted from outside and whose end was not
    reported within its grace period (None: it ended meanwhile); called under the lock."""
    if launch.state == "ended" or launch.name != name:
        return None
    launch.end()
    pod = pods.get(name)
    cause = _deletion_cause(pod.obj) if pod is not None else f"pod {name} deleted"
    return InstanceEvent(
        EventKind.LOST, launch.spec.id, detail=f"{cause}; its end was not reported within its grace period"
    )


class PodWatch:
    """The watch of the job's pods: every version goes to `on_pod(obj, deleted)`. `pods` (guarded
    by `lock`) is what the backend tracks, so a re-list can tell which pods went unseen;
    `list_pods` lists the job's pods; `run` (the watch thread) returns once `closed` is set. Before each
    request it passes the hook point faults.WATCH_REQUEST, where a test may hold it."""

    def __init__(
        self,
        core,
        namespace: str,
        selector: str,
        job_id: str,
        *,
        timeout_s: int,
        rv: str | None,
        closed: threading.Event,
        lock: threading.Lock,
        pods: dict[str, _Pod],
        list_pods: Callable[[], dict],
        on_pod: Callable[[dict, bool], None],
    ):
        self.core = core
        self.namespace = namespace
        self.selector = selector
        self.job_id = job_id
        self.timeout_s = timeout_s
        self.rv = rv
        self.closed = closed
        self.lock = lock
        self.pods = pods
        self.list_pods = list_pods
        self.on_pod = on_pod
        self.stats = {"relists": 0, "gone_410": 0, "watches": 0, "events": 0}  # events: pod versions watched
        self._resp = None

    def relist(self) -> None:
        t0 = time.monotonic()
        lst = self.list_pods()  # a consistent read: it has every pod created before it started
        names = {o["metadata"]["name"] for o in lst["items"]}
        for obj in lst["items"]:
            self.on_pod(obj, False)
        with self.lock:
            missed = [p.obj for n, p in self.pods.items() if n not in names and p.obj and p.tracked_at < t0]
        for obj in missed:  # deleted while we were not watching
            self.on_pod(obj, True)
        self.rv = lst["metadata"]["resourceVersion"]
        self.stats["relists"] += 1

    def wake(self) -> None:
        """Cut the open watch request short (closing, or a fault holding the watch)."""
        resp = self._resp
        if resp is not None:
            with contextlib.suppress(Exception):
                resp.shutdown() if hasattr(resp, "shutdown") else resp.connection.sock.shutdown(2)
            with contextlib.suppress(Exception):
                resp.close()

    def run(self) -> None:
        from kubernetes.client import ApiException
        from kubernetes.watch.watch import iter_resp_lines

        while not self.closed.is_set():
            faults.WATCH_REQUEST(self)
            if self.closed.is_set():
                break
            try:
                if self.rv is None:
                    self.relist()
                self.stats["watches"] += 1
                resp = self.core.list_namespaced_pod(
                    self.namespace,
                    label_selector=self.selector,
                    watch=True,
                    resource_version=self.rv,
                    allow_watch_bookmarks=True,
                    timeout_seconds=self.timeout_s,
                    _preload_content=False,
                    _request_timeout=(10, self.timeout_s + 30),
                )
                self._resp = resp
                try:
                    for line in iter_resp_lines(resp):
                        if self.closed.is_set():
                            break
                        ev = json.loads(line)
                        kind, obj = ev.get("type"), ev.get("object") or {}
                        if kind == "ERROR":
                            if obj.get("code") == 410:
                                self.stats["gone_410"] += 1
                                log.info("watch of job %s: 410 Gone (%s); re-listing", self.job_id, obj.get("message"))
                            else:
                                log.warning("watch of job %s: error %s; re-listing", self.job_id, obj)
                            self.rv = None
                            break
                        self.rv = (obj.get("metadata") or {}).get("resourceVersion") or self.rv
                        if kind == "BOOKMARK":
                            continue
                        self.stats["events"] += 1
                        self.on_pod(obj, kind == "DELETED")
                finally:
                    self._resp = None
                    with contextlib.suppress(Exception):
                        resp.release_conn()
            except ApiException as e:
                if e.status == 410:
                    self.stats["gone_410"] += 1
                    log.info("watch of job %s: 410 Gone; re-listing", self.job_id)
                    self.rv = None
                    continue
                if not self.closed.is_set():
                    log.warning(
                        "watch of job %s failed: %s", self.job_id, translate(e, "watch", "pods", self.namespace)
                    )
                    self.closed.wait(1.0)
            except Exception as e:  # noqa: BLE001 - connection trouble: resume from the last version
                if not self.closed.is_set():
                    log.warning("watch of job %s interrupted (%r); resuming", self.job_id, e)
                    self.closed.wait(0.5)
