"""What the master does when an instance ends: relaunch it, restore the job from its checkpoint, or fail
the job, and why.

A worker that was killed, preempted or scaled in is relaunched (the job keeps asking for
max_workers; a pending one starts when there is room). A worker that failed through the
user's model or data is not: relaunching it would fail the same way forever. Nor is one that
failed with an error not known to be the user's, when another instance already failed with the
same error on the same minibatch: the error is the data's or the code's, not the instance's, and
a relaunch would only loop. Nor is a worker the master left out for good (an allreduce straggler whose
replacement was as slow: master/gray/ring_straggler.py): the job trains on without it.
"""

from __future__ import annotations

import dataclasses
import logging

from elastic_step.backends.api import EventKind, InstanceEvent
from elastic_step.instance.api import EXIT_USER_ERROR

log = logging.getLogger("elastic_step.master")


# Why a worker was lost, as /metrics and the step's Kubernetes Events count it: the platform took it (Kueue, the
# scheduler), something killed it, the master gave it up (hung, a straggler, fenced), or it crashed.
LOSS_CAUSES = ("preempted", "kueue", "killed", "hung", "straggler", "fenced", "crash", "exited")


def loss_cause(ev: InstanceEvent) -> str:
    """The cause of a worker's end, one of LOSS_CAUSES, from the event as the master takes it (gray/policy.py
    names what the master gave up; the backends name what the platform did)."""
    detail = ev.detail or ""
    if detail.startswith("declared hung"):
        return "hung"
    if detail.startswith("left out as a straggler"):
        return "straggler"
    if detail.startswith("fenced, then"):
        return "fenced"
    if ev.kind == EventKind.EXITED:
        return "exited" if ev.exit_code in (0, None) else "crash"
    if "by Kueue" in detail:
        return "kueue"
    # The scheduler's preemption, or another disruption the pod's DisruptionTarget names (backends/kubernetes/pods.py)
    if detail.startswith(("preempted", "evicted")) or (detail.startswith("pod ") and " deleted: " in detail):
        return "preempted"
    return "killed"


@dataclasses.dataclass(frozen=True)
class Decision:
    action: str  # "relaunch" | "restore" | "fail" | "retire" | "none"
    reason: str


class RelaunchPolicy:
    """Decides, for each instance that ends, to relaunch it, restore the job from its checkpoint (a lost PS)
    or fail the job; relaunches count against the job's budget (`max_relaunches`)."""

    def __init__(self, max_relaunches: int):
        self.max_relaunches = max_relaunches
        self.relaunches = 0
        # (minibatch, error) -> the instances that reported that error on that minibatch, in order
        self.failed_on: dict[tuple[str, str], list[str]] = {}
        self.retired: dict[str, str] = {}  # instance -> why it is not relaunched when it ends (see `retire`)

    def retire(self, inst, why: str) -> None:
        """`inst` is being stopped and left out for good: its end is not relaunched."""
        self.retired[str(inst)] = why

    CRASH_LOOP = 3  # consecutive launches of one worker that crash before committing anything
    SAME_ERROR = 2  # instances failing with one error on one minibatch: the error is final

    def on_end(
        self,
        ev: InstanceEvent,
        job_over: bool,
        reported_failure: bool,
        crashes_without_progress: int = 0,
        checkpoint: bool = False,
        report: dict | None = None,
    ) -> Decision:
        """`checkpoint`: the job has one to go back to (a lost PS is survivable only then). `report`: the
        failure the instance reported before it ended, if any (its `message` and the `minibatch` it was on)."""
        inst = ev.instance
        if job_over:
            return Decision("none", f"{inst} ended after training finished")
        if ev.exit_code == EXIT_USER_ERROR or reported_failure:
            return Decision("fail", f"{inst} failed on the user's model or data (exit {ev.exit_code})")
        if (same := self._same_error(inst, report)) is not None:
            return same
        if inst.role == "ps":
            if not checkpoint:
                return Decision(
                    "fail",
                    f"parameter server {inst} was lost ({ev.detail or ev.exit_code}) and the "
                    "job has no checkpoint to restore the shards from (--checkpoint-every 0)",
                )
            if (over := self._over_budget(inst, ev)) is not None:
                return over
            return Decision(
                "restore",
                f"parameter server {inst} was lost ({ev.detail or ev.exit_code}): it is "
                "relaunched, and every shard and the ledger go back to the last checkpoint",
            )
        if (
            ev.kind == EventKind.EXITED
            and ev.exit_code not in (0, None)
            and crashes_without_progress >= self.CRASH_LOOP
        ):
            return Decision(
                "fail",
                f"{inst} crashed (exit {ev.exit_code}) {crashes_without_progress} times "
                "in a row before committing any record: not relaunching a crash loop",
            )
        if (why := self.retired.pop(str(inst), None)) is not None:
            return Decision("retire", f"{inst} is not relaunched: {why}")
        if (over := self._over_budget(inst, ev)) is not None:
            return over
        why = {EventKind.LOST: ev.detail or "lost"}.get(ev.kind, f"exited with code {ev.exit_code}")
        return Decision("relaunch", f"{inst} {why} before training finished")

    def _same_error(self, inst, report: dict | None) -> Decision | None:
        """Fail when `report` is the error another instance already failed with on the same minibatch."""
        if not report or not report.get("minibatch"):
            return None
        minibatch, error = report["minibatch"], report["message"].strip()
        seen = self.failed_on.setdefault((minibatch, error), [])
        seen.append(str(inst))
        if len(seen) < self.SAME_ERROR:
            return None
        first, *rest = error.splitlines() or [""]
        return Decision(
            "fail",
            f"{' and then '.join(seen)} failed with the same error on {minibatch}, so it is the data's or the "
            f"code's, not the instance's: not relaunching it again. The error: {first}"
            + "".join(f"\n{line}" for line in rest),
        )

    def _over_budget(self, inst, ev: InstanceEvent) -> Decision | None:
        """A relaunch counts against the job's budget; past it, the job fails instead of spinning."""
        if self.relaunches >= self.max_relaunches:
            return Decision(
                "fail",
                f"{inst} ended ({ev.detail or f'exit {ev.exit_code}'}) and the job already "
                f"relaunched {self.relaunches} instances (limit {self.max_relaunches})",
            )
        self.relaunches += 1
        return None
