"""Restart (adoption): a new master takes over the pods its predecessor left.

On construction the backend lists the job's pods. Live ones (Pending/Running, not deleting)
are *adopted*: when the master starts that instance again, no second pod is created. An
adopted pod whose command is exactly the new one (same master address, same token: the
Secret's token is reused, see `KubernetesBackend.from_train_config`) is kept and re-owned
(ownerReference patched to the new step pod). Otherwise (the usual case: a restarted step is a
new pod with a new IP, and the master listens on a fresh port) the old instance's master
connection is dead: its argv points at the old master, which no longer exists, so it can never
register again (left alone, a PS stops after ~10 s of failed heartbeats, a worker after its RPCs
have retried for 60 s). Such a pod is deleted at once (grace 0) and its replacement created in
its place; the new master restores the shards and the ledger from the job's last checkpoint
(master/durability/checkpoint.py). Finished pods of the old master are deleted.
"""

from __future__ import annotations

import contextlib
import logging

from elastic_step.backends.api import InstanceId, InstanceSpec
from elastic_step.backends.kubernetes.pods import LABEL_LAUNCH, TERMINAL, _Pod, container_command, track

log = logging.getLogger("elastic_step.backends.kubernetes")


def adopt(
    items: list[dict], pods: dict[str, _Pod], numbers: dict[InstanceId, int], job_id: str
) -> tuple[dict[InstanceId, str], list[str]]:
    """Track the previous master's pods (`items`, a listing of the job's pods) in `pods`, raise
    `numbers` to their launch numbers, and return (the live pod of each instance, the pods to
    delete: finished ones, and the older of two live pods of one instance)."""
    adoptable: dict[InstanceId, str] = {}
    leftovers = []
    for obj in items:
        pod = track(pods, obj)
        if pod is None:
            continue
        inst = pod.inst
        with contextlib.suppress(ValueError, KeyError):
            n = int(obj["metadata"]["labels"].get(LABEL_LAUNCH, "1"))
            numbers[inst] = max(numbers.get(inst, 0), n)
        if pod.live:
            other = adoptable.get(inst)
            if other is not None:  # two live pods of one instance: keep the latest launch
                older, pod_name = sorted([other, pod.name], key=lambda name: launch_number(pods, name))
                leftovers.append(older)
                adoptable[inst] = pod_name
            else:
                adoptable[inst] = pod.name
        elif pod.phase in TERMINAL and not pod.deleting:
            leftovers.append(pod.name)
    if adoptable or leftovers:
        log.info(
            "job %s: adopting %d live pod(s) of a previous master (%s); deleting %d finished one(s)",
            job_id,
            len(adoptable),
            ", ".join(sorted(adoptable.values())),
            len(leftovers),
        )
    return adoptable, leftovers


def launch_number(pods: dict[str, _Pod], name: str) -> int:
    with contextlib.suppress(KeyError, ValueError):
        return int(pods[name].obj["metadata"]["labels"][LABEL_LAUNCH])
    return 0


def compatible(pod: _Pod, spec: InstanceSpec, token_reused: bool) -> bool:
    """Whether the adopted pod runs exactly `spec` (so it can be kept rather than replaced)."""
    containers = (pod.obj.get("spec") or {}).get("containers") or [{}]
    return token_reused and containers[0].get("command") == container_command(spec.argv)


def reown_patch(pod: _Pod, refs: list[dict]) -> list[dict] | None:
    """The JSON patch that makes `refs` the kept pod's owners; None when they are already."""
    if [o.get("uid") for o in pod.obj["metadata"].get("ownerReferences") or []] == [o["uid"] for o in refs]:
        return None
    # A JSON patch replaces the list (a strategic merge would add to it, keyed by uid).
    return (
        [{"op": "add", "path": "/metadata/ownerReferences", "value": refs}]
        if refs
        else [{"op": "remove", "path": "/metadata/ownerReferences"}]
    )
