"""Pods that wait: a launch whose pod is still pending past a bound is reported with what holds it.

A worker that a Kueue queue keeps waiting, or that no node can hold, leaves the job below strength. The master
must say so, and why, rather than wait in silence. What holds a pod is read where Kubernetes keeps it:
* while Kueue's admission gate is on the pod: Kueue's Workload of that pod (the one it owns), and the condition
  that says why it is not admitted (QuotaReserved False: e.g. no quota left in the ClusterQueue), or that it is
  admitted and the gate not yet lifted;
* otherwise: the pod's PodScheduled condition (the scheduler's reason, e.g. Unschedulable: no node has room).
Each pod is reported once per bound it waits (at 1, 2, 3 ... bounds), as a WAITING event; it keeps waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from elastic_step.backends.kubernetes.kueue import ADMISSION_GATE, GROUP, VERSION, owned_workload

log = logging.getLogger("elastic_step.backends.kubernetes")

# Workload conditions in the order that best explains a wait: not admitted, then evicted, then admitted.
_EXPLAINING = ("QuotaReserved", "Evicted", "Admitted")


def gated(obj: dict) -> bool:
    """Whether Kueue's admission gate holds the pod (Kueue has not admitted its workload yet)."""
    return any(g.get("name") == ADMISSION_GATE for g in (obj.get("spec") or {}).get("schedulingGates") or [])


def _condition(conds: list[dict], kind: str) -> dict | None:
    return next((c for c in conds if c.get("type") == kind), None)


def queue_reason(obj: dict, workloads: list[dict] | None) -> str:
    """Why Kueue holds the pod, in Kueue's words: its Workload and the condition that explains the wait.
    `workloads`: the namespace's Workloads, or None when they cannot be read."""
    queue = ((obj.get("metadata") or {}).get("labels") or {}).get("kueue.x-k8s.io/queue-name", "")
    held = f"held by Kueue's admission gate in queue {queue!r}"
    if workloads is None:
        return f"{held} (its Workload cannot be read: give the step's Role list on workloads.{GROUP})"
    wl = owned_workload(workloads, uid=(obj.get("metadata") or {}).get("uid", ""))
    if wl is None:
        return f"{held}; Kueue has made no Workload for it yet"
    conds = (wl.get("status") or {}).get("conditions") or []
    name = wl["metadata"]["name"]
    for kind in _EXPLAINING:
        c = _condition(conds, kind)
        if c is None:
            continue
        if kind == "QuotaReserved" and c.get("status") != "True":
            return f"{held}: Workload {name} not admitted ({c.get('reason')}): {c.get('message', '')}".rstrip(": ")
        if kind == "Evicted" and c.get("status") == "True":
            return f"{held}: Workload {name} evicted ({c.get('reason')}): {c.get('message', '')}".rstrip(": ")
        if kind == "Admitted" and c.get("status") == "True":
            return f"{held}: Workload {name} is admitted, and the gate is not yet lifted"
    return f"{held}: Workload {name} has no condition yet (Kueue has not looked at it)"


def schedule_reason(obj: dict) -> str:
    """Why the scheduler has not placed the pod (its PodScheduled condition), or that it is placed and starting."""
    status = obj.get("status") or {}
    c = _condition(status.get("conditions") or [], "PodScheduled")
    if (obj.get("spec") or {}).get("nodeName"):
        return f"on node {obj['spec']['nodeName']}, not running yet"
    if c is not None and c.get("status") == "False":
        return f"not scheduled ({c.get('reason')}): {c.get('message', '')}".rstrip(": ")
    return "not scheduled yet"


def what_holds(obj: dict, read_workloads: Callable[[], list[dict] | None]) -> str:
    """What keeps this pending pod from running, read from Kueue or the scheduler."""
    return queue_reason(obj, read_workloads()) if gated(obj) else schedule_reason(obj)


def due(pending_for: float, reported: int, bound: float) -> bool:
    """Whether a pod pending for `pending_for` seconds, reported `reported` times already, is due a report."""
    return bound > 0 and pending_for >= bound * (reported + 1)


def read_workloads(custom, namespace: str, call) -> Callable[[], list[dict] | None]:
    """A reader of the namespace's Kueue Workloads for `what_holds`: None once the Role proves unable to list
    them (logged once: the reports then say what to grant)."""
    refused = False

    def read() -> list[dict] | None:
        nonlocal refused
        if refused:
            return None
        try:
            return call(
                "list", "workloads", custom.list_namespaced_custom_object, GROUP, VERSION, namespace, "workloads"
            )["items"]
        except Exception as e:  # noqa: BLE001 - a report must never fail the job
            if getattr(e, "status", None) == 403:
                refused = True
            log.warning(
                "cannot read Kueue's Workloads in %s (%s): pending pods are reported without them", namespace, e
            )
            return None

    return read
