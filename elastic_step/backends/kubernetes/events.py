"""Kubernetes Events (events.k8s.io/v1) about the step, recorded on the step's own pod, so that `kubectl describe` on
it, and whatever watches a namespace's Events, shows what the master saw: a worker lost and why, hung, fenced, a
PS restored, the job's end.

Aggregated as client-go's recorder does, so that a long job cannot flood the apiserver: the same type, reason and
note again is one Event whose `series` counts it (patched at most every `FLUSH_S`, and when the step ends), and past
`SIMILAR_MAX` distinct notes of one reason within `SIMILAR_WINDOW_S` the rest become one Event of that reason,
"(combined from similar events)", counted the same way. Sent by a thread of its own: the master's pump never
waits on the apiserver. A right the Role lacks (manifests/role.yaml: create and patch events) is a warning, once,
and no Event is sent again; nothing an Event fails to say fails the job.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable

from elastic_step.backends.kubernetes.config import Owner

log = logging.getLogger("elastic_step.backends.kubernetes")

CONTROLLER = "elastic-step.dev/master"  # reportingController: who speaks
FLUSH_S = 10.0  # an Event's series is patched at most this often
SIMILAR_MAX = 10  # distinct notes of one reason, within
SIMILAR_WINDOW_S = 600.0  # ... this long, before the rest are combined (client-go's EventAggregator's figures)
NOTE_MAX = 1024  # the API's limit on a note, in bytes
COMBINED = "(combined from similar events): "


@dataclasses.dataclass
class _Sent:
    name: str  # the Event's name
    count: int = 1
    last: float = 0.0
    patched: int = 1  # the count the apiserver has


def micro_time(t: float) -> str:
    """A MicroTime, as the API writes it."""
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class EventRecorder:
    """Events on `regarding` (the step's pod) in `namespace`, sent through `events_api` (an EventsV1Api)."""

    def __init__(
        self, events_api, namespace: str, regarding: Owner, instance: str, clock: Callable[[], float] = time.time
    ):
        self.api, self.namespace, self.regarding, self.instance = events_api, namespace, regarding, instance
        self._clock = clock
        self._queue: queue.Queue = queue.Queue()
        self._sent: dict[tuple[str, str, str], _Sent] = {}
        self._notes: dict[tuple[str, str], list[float]] = {}  # (type, reason) -> when each distinct note came
        self._refused = False
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="k8s-events", daemon=True)
        self._thread.start()

    def record(self, reason: str, note: str, action: str, warning: bool = False) -> None:
        """An Event about the step (`reason`: CamelCase, what happened; `action`: what the master did about it)."""
        self._queue.put(("Warning" if warning else "Normal", reason, note, action, self._clock()))

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued and every series' last count, within `timeout_s`."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        last_flush = self._clock()
        while True:
            try:
                item = self._queue.get(timeout=FLUSH_S)
            except queue.Empty:
                item = ()
            if item is None:
                self._flush()
                return
            if item:
                self._one(*item)
            if self._clock() - last_flush >= FLUSH_S:
                self._flush()
                last_flush = self._clock()

    def _one(self, type_: str, reason: str, note: str, action: str, t: float) -> None:
        note = note.encode()[:NOTE_MAX].decode(errors="ignore")
        key = (type_, reason, note)
        if key not in self._sent:
            seen = [s for s in self._notes.get((type_, reason), []) if t - s < SIMILAR_WINDOW_S]
            seen.append(t)
            self._notes[(type_, reason)] = seen
            if len(seen) > SIMILAR_MAX:  # one more distinct note of a reason already frequent: combined
                key = (type_, reason, COMBINED)
                note = (COMBINED + note).encode()[:NOTE_MAX].decode(errors="ignore")
        sent = self._sent.get(key)
        if sent is not None:
            sent.count, sent.last = sent.count + 1, t
            return
        name = f"{self.regarding.name}.{uuid.uuid4().hex[:16]}"
        body = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": self.namespace},
            "eventTime": micro_time(t),
            "reportingController": CONTROLLER,
            "reportingInstance": self.instance[:128],
            "action": action[:128],
            "reason": reason[:128],
            "note": note,
            "type": type_,
            "regarding": {"apiVersion": "v1", "kind": "Pod", "namespace": self.namespace, **self._regarding()},
        }
        if self._send("create", self.api.create_namespaced_event, self.namespace, body):
            self._sent[key] = _Sent(name, last=t)

    def _regarding(self) -> dict:
        return {"name": self.regarding.name, "uid": self.regarding.uid}

    def _flush(self) -> None:
        for sent in self._sent.values():
            if sent.count > sent.patched:
                patch = {"series": {"count": sent.count, "lastObservedTime": micro_time(sent.last)}}
                if self._send("patch", self.api.patch_namespaced_event, sent.name, self.namespace, patch):
                    sent.patched = sent.count

    def _send(self, verb: str, fn, *args) -> bool:
        if self._refused:
            return False
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - an Event never fails the job: said once, then quiet
            status = getattr(e, "status", None)
            if status == 403:
                self._refused = True
                log.warning(
                    "no Kubernetes Events about the step: its service account may not %s events.k8s.io events in "
                    "namespace %s (add 'create' and 'patch' on 'events' of group 'events.k8s.io' to its Role: see "
                    "elastic_step/backends/manifests/role.yaml)",
                    verb,
                    self.namespace,
                )
            elif not self._failing:
                self._failing = True
                log.warning("a Kubernetes Event about the step could not be sent (%s); the step goes on", e)
            return False
        self._failing = False
        return True
