"""Pods: what the job's pods look like, and what the backend knows of each.

`<job>-<role>-<index>` (a relaunch: `<job>-<role>-<index>-<launch>`), labels `elastic-step/job`,
`elastic-step/role`, `elastic-step/index`, `elastic-step/launch` and
`app.kubernetes.io/managed-by: elastic-step`; command = the instance's argv, with the image's `python` for the
master's own interpreter (container_command); the job token from
the Secret `<job>-token` (`secretKeyRef`, never a literal), `ELASTIC_STEP_POD_IP` from the
downward API (`status.podIP`: a PS serves and advertises on it); requests = limits = the
instance's cpu/memory; `priorityClassName` (default `elastic-low` for workers, `elastic-high`
for PS, when the cluster has them: see manifests/priorityclasses.yaml); restartPolicy Never;
the `restricted` Pod Security level's security context (security.py); no service-account token;
terminationGracePeriodSeconds 30; an ownerReference (blockOwnerDeletion false) to the step's pod:
`KFP_POD_NAME`/`KFP_POD_UID`, else the master's own pod (`POD_NAME`/`POD_UID` from the downward API), else
none. The job's pod settings (resources, tolerations, node selector, affinity, service account, env, volumes,
spot: settings.py) dress each role's pods. `ELASTIC_STEP_POD_SPEC` (JSON, an escape hatch under those settings)
is merged into every pod's spec: imagePullSecrets, schedulerName, a securityContext, and fields of the role's
container by its name; `ELASTIC_STEP_POD_LABELS` (JSON, by role) adds labels, e.g. a coscheduling PodGroup's
`scheduling.x-k8s.io/pod-group` on the workers.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import threading
import time

from elastic_step.backends.api import InstanceId, InstanceSpec
from elastic_step.backends.kubernetes.config import POD_IP_ENV
from elastic_step.backends.kubernetes.kueue import eviction_cause, queue_metadata
from elastic_step.backends.kubernetes.security import CONTAINER_SECURITY_CONTEXT, POD_SECURITY_CONTEXT, merge
from elastic_step.backends.kubernetes.settings import PodSettings
from elastic_step.errors import ConfigError
from elastic_step.instance.api import TOKEN_ENV

PRIORITY_FILE = "elastic_step/backends/manifests/priorityclasses.yaml"

LABEL_JOB = "elastic-step/job"
LABEL_ROLE = "elastic-step/role"
LABEL_INDEX = "elastic-step/index"
LABEL_LAUNCH = "elastic-step/launch"
MANAGED_BY = ("app.kubernetes.io/managed-by", "elastic-step")
TOKEN_KEY = "token"
DEFAULT_PRIORITY = {"worker": "elastic-low", "ps": "elastic-high"}
TERMINAL = ("Succeeded", "Failed")

_JOB_ID = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
IMAGE_PYTHON = "python"  # the image's interpreter, first on its PATH (images/)


def container_command(argv: list[str]) -> list[str]:
    """The pod's command for an instance's `argv`: the master's own interpreter, a path on the master's machine
    that the image need not have (a master run from a laptop's venv), becomes the image's `python`."""
    if argv and argv[0] == sys.executable:
        return [IMAGE_PYTHON, *argv[1:]]
    return list(argv)


def job_labels(job_id: str, inst: InstanceId | None = None, number: int | None = None) -> dict:
    """The labels of the job's objects: its Secret (job only) and its pods (instance, launch)."""
    out = {LABEL_JOB: job_id, MANAGED_BY[0]: MANAGED_BY[1]}
    if inst is not None:
        out.update({LABEL_ROLE: inst.role, LABEL_INDEX: str(inst.index)})
    if number is not None:
        out[LABEL_LAUNCH] = str(number)
    return out


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
    forced: bool = False  # deleted with grace 0 by us: its process is killed
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
    state: str = "deferred"  # deferred -> pending -> running -> ended
    blocker: str = ""  # predecessor pod whose process must end first
    blocked_until_gone: bool = False  # ... and, in a Kueue queue, be gone from the API with its Workload (kueue.py)
    workload_deadline: float | None = None  # monotonic: past it, the replacement no longer waits on that Workload
    stopping: bool = False  # we deleted it gracefully (scale-in): EXITED with its code
    killing: bool = False  # we deleted it with grace 0: LOST
    adopted: bool = False
    ended: threading.Event = dataclasses.field(default_factory=threading.Event)
    timer: threading.Timer | None = None  # forces a deferred creation
    loss_timer: threading.Timer | None = None  # bounds the wait for a deleted pod's end
    pending_since: float | None = None  # monotonic time its pod was created (or adopted) pending
    waits_reported: int = 0  # WAITING events given for its pod (pending.py)

    def end(self) -> None:
        self.state = "ended"
        self.ended.set()
        for timer in (self.timer, self.loss_timer):
            if timer:
                timer.cancel()


def track(pods: dict[str, _Pod], obj: dict) -> _Pod | None:
    """Record this version of a pod in `pods` (by name; a new uid is a new pod); None when it is
    not one of an instance's pods."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        inst = InstanceId(labels[LABEL_ROLE], int(labels[LABEL_INDEX]))
    except (KeyError, ValueError, ConfigError):
        return None
    pod = pods.get(meta["name"])
    if pod is None or (pod.uid and meta.get("uid") and pod.uid != meta["uid"]):
        pod = pods[meta["name"]] = _Pod(meta["name"], inst)
    pod.uid = meta.get("uid", pod.uid)
    pod.obj = obj
    pod.phase = (obj.get("status") or {}).get("phase")
    pod.deleting = pod.deleting or meta.get("deletionTimestamp") is not None
    return pod


def _terminated(obj: dict) -> dict | None:
    for cs in (obj.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            return term
    return None


def _deletion_cause(obj: dict) -> str:
    name = obj["metadata"]["name"]
    if cause := eviction_cause(obj):
        return cause
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            if c.get("reason") == "PreemptionByScheduler":
                return f"preempted by the scheduler (pod {name} deleted)"
            return f"pod {name} deleted: {c.get('reason')}: {c.get('message', '')}".rstrip(": ")
    return f"pod {name} deleted from outside the master"


def pod_body(
    launch: _Launch,
    *,
    job_id: str,
    namespace: str,
    image: str,
    secret_name: str,
    grace_s: int,
    pod_spec: dict,
    default_priority: str | None,
    owner_refs: list[dict],
    pod_labels: dict[str, dict[str, str]] | None = None,
    queue: str = "",
    num_ps: int = 0,
    settings: PodSettings | None = None,
) -> dict:
    """The pod of `launch` (named already); `default_priority`: the role's PriorityClass when the
    instance names none; `pod_labels`: extra labels by role (or `*`), the backend's own win; `settings`: what
    dresses the role's pods (settings.py), over `pod_spec`'s fields."""
    spec, inst = launch.spec, launch.spec.id
    env = [
        {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": TOKEN_KEY}}},
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "ELASTIC_STEP_JOB_ID", "value": job_id},
    ]
    env += [{"name": k, "value": v} for k, v in spec.env.items() if k not in (TOKEN_ENV, POD_IP_ENV)]
    quantities = {k: v for k, v in (("cpu", spec.cpu), ("memory", spec.memory)) if v}
    # ELASTIC_STEP_POD_SPEC's container of this role is merged into the backend's (config.py); its own fields win.
    given = next((c for c in pod_spec.get("containers", []) if c.get("name") == inst.role), {})
    container = merge({"imagePullPolicy": "IfNotPresent", "securityContext": CONTAINER_SECURITY_CONTEXT}, given)
    names = {e["name"] for e in env}
    container.update(
        name=inst.role,
        image=image,
        command=container_command(spec.argv),
        env=[e for e in container.get("env", []) if e.get("name") not in names] + env,
    )
    if quantities:
        container["resources"] = {
            **container.get("resources", {}),
            "requests": dict(quantities),
            "limits": dict(quantities),
        }
    defaults = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": grace_s,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": POD_SECURITY_CONTEXT,
    }
    body_spec = {**merge(defaults, {k: v for k, v in pod_spec.items() if k != "containers"}), "containers": [container]}
    (settings or PodSettings()).dress(inst.role, body_spec, container)
    priority = spec.priority_class or default_priority
    if priority:
        body_spec["priorityClassName"] = priority
    queue_labels, annotations = queue_metadata(queue, inst.role, job_id, num_ps)
    metadata = {
        "name": launch.name,
        "namespace": namespace,
        "labels": {
            **(pod_labels or {}).get("*", {}),
            **(pod_labels or {}).get(inst.role, {}),
            **queue_labels,
            **job_labels(job_id, inst, launch.number),
        },
        "ownerReferences": owner_refs,
    }
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": body_spec}
