"""What the master tells the platform as it happens (on Kubernetes, Events on the step's pod: backends/kubernetes/
events.py), from its own timeline: each turn of the pump reads the timeline's new entries and passes on those a
platform team acts on. The backend sends them on a thread of its own and aggregates the repeated ones.

| timeline entry | reason | type | action |
|---|---|---|---|
| a worker's end the master acts on | WorkerLost (its cause; Kueue's reason) | Warning | Relaunch, Fail, Retire |
| a PS shard's end | ParameterServerLost | Warning | Restore, Fail |
| hung | WorkerHung, ParameterServerHung | Warning | Fence, Kill |
| fenced | WorkerFenced | Warning | Fence |
| straggler | StragglerHandedOver (ps), StragglerLeftOut (allreduce) | Normal, Warning | HandOver, LeaveOut |
| rewound | ParameterServerRestored, Rewound (every member lost) | Warning | Restore, Rewind |
| resumed | CheckpointRestored | Normal | Resume |
| the job's end | TrainingFinished, JobFailed | Normal, Warning | Finish, Fail |
"""

from __future__ import annotations

from collections.abc import Callable

Tell = Callable[..., None]  # Backend.tell(reason, note, action, warning=...)


class Notices:
    def __init__(self, tell: Tell, timeline: list[dict]):
        """`timeline`: the coordinator's events, appended to as the job goes (read, never written)."""
        self._tell, self._timeline, self._seen = tell, timeline, 0

    def tick(self) -> None:
        """Pass on the timeline's entries since the last tick."""
        end = len(self._timeline)
        for entry in self._timeline[self._seen : end]:
            told = notice(entry)
            if told is not None:
                self._tell(*told[:3], warning=told[3])
        self._seen = end

    def finished(self, note: str) -> None:
        self.tick()
        self._tell("TrainingFinished", note, "Finish", warning=False)

    def failed(self, note: str) -> None:
        self.tick()
        self._tell("JobFailed", note, "Fail", warning=True)


def notice(entry: dict) -> tuple[str, str, str, bool] | None:
    """(reason, note, action, warning) for a timeline entry the platform hears of, else None."""
    kind, who, detail = entry.get("kind"), entry.get("instance", ""), entry.get("detail", "")
    ps = who.startswith("ps-")
    if kind == "decision":
        action, _, why = detail.partition(": ")
        verb = action.capitalize()
        if ps:
            return "ParameterServerLost", f"{who}: {why}", verb, True
        return "WorkerLost", f"{who} lost ({entry.get('cause', 'unknown cause')}): {why}", verb, True
    if kind == "hung":
        return (
            ("ParameterServerHung", f"{who}: {detail}", "Kill", True)
            if ps
            else ("WorkerHung", f"{who}: {detail}", "Fence", True)
        )
    if kind == "fenced":
        return "WorkerFenced", f"{who}: {detail}", "Fence", True
    if kind == "straggler":
        if "action" in entry:  # allreduce: left out of the ring (ring_straggler.py's figures name the action)
            return "StragglerLeftOut", f"{who}: {detail}", "LeaveOut", True
        return "StragglerHandedOver", f"{who}: {detail}", "HandOver", False
    if kind == "rewound":
        if ps:
            return "ParameterServerRestored", f"every PS shard restored after {who} was lost, {detail}", "Restore", True
        return "Rewound", detail, "Rewind", True
    if kind == "resumed":
        return "CheckpointRestored", f"resumed {detail}", "Resume", False
    return None
