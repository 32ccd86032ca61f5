"""Kueue: how the job's pods go through a cluster's queues and quotas (`queue`, a Kueue LocalQueue).

Kueue's plain-pod integration admits pods by label. The job's pods form these workloads:

* every **worker** pod is a workload of its own, so Kueue admits workers one at a time as the quota allows
  (the job trains with those admitted; the rest are Pending behind Kueue's scheduling gate, which the master
  already reads as "not running yet");
* the **parameter servers** form one pod group (`<job>-ps`, all `num_ps` of them), admitted whole or not at all:
  a job with some of its shards is no job;
* the **master** is the step's own pod, made by KFP or Argo: it cannot be in the PS group (it creates the PS
  pods, so that group would wait on it), and goes through the queue only if the pipeline labels it.

Kueue preempts the lowest priority first, and reads a plain pod's priority from its PriorityClass: workers
(`elastic-low`) go before the core (`elastic-high`). An evicted or preempted pod is given the condition
`TerminationTarget` and deleted: to the master that is a loss like any other, and its replacement waits in
the queue.
"""

from __future__ import annotations

from elastic_step.backends.kubernetes.errors import KubernetesBackendError
from elastic_step.errors import ConfigError

GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
POD_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
POD_GROUP_COUNT = "kueue.x-k8s.io/pod-group-total-count"
ADMISSION_GATE = "kueue.x-k8s.io/admission"  # the scheduling gate a queued pod carries until Kueue admits it
EVICTED_CONDITION = "TerminationTarget"  # what Kueue sets on a pod it stops, before deleting it
NEEDED = (("get", "localqueues", GROUP),)  # the Role's extra rule when a queue is set
# ... and the one it does without: a pod the queue keeps pending is then reported without Kueue's reason
WANTED = {("list", "workloads", GROUP): "a pod the queue keeps pending is reported without Kueue's reason"}


def in_group(queue: str, role: str) -> bool:
    """Whether a pod of `role` is in a Kueue pod group (the parameter servers, admitted whole)."""
    return bool(queue) and role == "ps"


def replaces_once_gone(queue: str) -> bool:
    """Whether a queued pod's replacement waits until its predecessor, and the predecessor's Workload, have left
    the API. A pod group counts a member Kueue has not yet seen end as active, so a replacement beside it is one
    pod too many (Kueue deletes it). And Kueue puts a preempted pod's Workload back in the queue, where it stays
    until the garbage collector deletes it after its pod: older than the replacement, it is first in line, and
    when quota frees Kueue can admit it just before it is deleted, then drop that quota without trying the
    Workloads behind it again (Kueue 0.15), so the replacement would wait for ever. One Workload per pod of the
    job in the queue at a time."""
    return bool(queue)


def owned_workload(workloads: list[dict], *, uid: str = "", name: str = "") -> dict | None:
    """The Workload Kueue made for a pod (it owns it), found by the pod's uid, or by its name once the pod is gone
    (the backend never reuses a pod name), if any."""
    for wl in workloads:
        for o in wl["metadata"].get("ownerReferences") or []:
            if o.get("kind") == "Pod" and (o.get("uid") == uid if uid else o.get("name") == name):
                return wl
    return None


def queue_metadata(queue: str, role: str, job_id: str, num_ps: int) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) that put a pod of `role` in `queue` (none without a queue)."""
    if not queue:
        return {}, {}
    labels = {QUEUE_LABEL: queue}
    if not in_group(queue, role):
        return labels, {}
    return {**labels, POD_GROUP_LABEL: f"{job_id}-ps"}, {POD_GROUP_COUNT: str(num_ps)}


def eviction_cause(obj: dict) -> str | None:
    """Why Kueue stopped this pod (its TerminationTarget condition), or None when Kueue did not."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == EVICTED_CONDITION and c.get("status") == "True":
            # The reason is the workload's: WorkloadEvictedDueTo<Preempted|PodsReadyTimeout|NodeFailures|...>
            why = (c.get("reason") or "").removeprefix("WorkloadEvictedDueTo")
            what = "preempted" if why == "Preempted" else f"evicted ({why})" if why else "evicted"
            message = f": {c['message']}" if c.get("message") else ""
            return f"{what} by Kueue (pod {obj['metadata']['name']}){message}"
    return None


def check_local_queue(custom, namespace: str, queue: str, call) -> None:
    """Fail before any pod exists when the LocalQueue is missing: Kueue would leave every pod gated for ever.
    `custom`: a CustomObjectsApi; `call`: the backend's API call (refusals become clear errors)."""
    try:
        call(
            "get",
            "localqueues",
            custom.get_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            "localqueues",
            queue,
        )
    except KubernetesBackendError as e:
        if e.status != 404:
            raise
        if f'"{queue}" not found' not in str(e):  # the resource itself is unknown: no Kueue in this cluster
            raise ConfigError(
                f"queue {queue!r}: this cluster has no Kueue (no resource localqueues.{GROUP}/{VERSION}): install "
                "Kueue, or leave the queue empty to create the job's pods directly."
            ) from None
        raise ConfigError(
            f"queue {queue!r}: there is no Kueue LocalQueue {queue!r} in namespace {namespace}: create it (kind "
            f"LocalQueue, apiVersion {GROUP}/{VERSION}, spec.clusterQueue), or name one that exists "
            f"(kubectl get localqueues -n {namespace})."
        ) from None
