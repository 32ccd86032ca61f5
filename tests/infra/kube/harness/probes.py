"""The process kubelet's prober: a container's ``httpGet`` liveness and readiness probes, run as a kubelet runs them.

For each start of a container that declares them (``start_probes``, from pod.py once its process runs):

* after ``initialDelaySeconds`` (0), every ``periodSeconds`` (10), a GET of ``scheme://host:port/path`` (host: the
  pod's IP unless the probe names one; port: a number or the name of one of the container's ports; the probe's
  ``httpHeaders``), given ``timeoutSeconds`` (1) to answer; a status from 200 to 399 is a success, anything else,
  a refused connection or no answer in time a failure;
* ``failureThreshold`` (3) failures in a row fail the probe, ``successThreshold`` (1) successes in a row pass it;
* a failed liveness probe kills the container as the kubelet does: SIGTERM, then SIGKILL after the probe's
  ``terminationGracePeriodSeconds``, else the pod's (30); the container then ends, or restarts under the pod's
  ``restartPolicy`` (pod.py counts its ``restartCount``), and the new start is probed afresh;
* a readiness probe holds the container not ready from its start until the probe passes, and sets it not ready
  again when it fails: the pod's ``Ready`` and ``ContainersReady`` conditions follow;
* every failed probe is an Event ``Unhealthy`` on the pod, and the liveness kill an Event ``Killing``, with the
  kubelet's wording, so a test (or ``kubectl describe``) sees why a container was restarted.

Not implemented: ``startupProbe``, and ``exec``, ``tcpSocket`` and ``grpc`` probes (a pod that declares one runs
without it, and the kubelet's log says so).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import ssl
import threading
import time

from .mounts import namespace_init

KINDS = {"livenessProbe": "Liveness", "readinessProbe": "Readiness"}


def start_probes(container) -> ContainerProbes | None:
    """Start the probes of a container that has just started (pod.py's Container); None when it declares none."""
    probes = {kind: container.spec[kind] for kind in KINDS if container.spec.get(kind) and not container.init}
    log, ref = container.pod.k.log, container.pod.ref
    for kind, probe in list(probes.items()):
        if "httpGet" not in probe:
            log.warning("%s: %s: %s without httpGet is not run by the process kubelet", ref, container.name, kind)
            del probes[kind]
    for kind in ("startupProbe",):
        if container.spec.get(kind):
            log.warning("%s: %s: %s is not run by the process kubelet", ref, container.name, kind)
    if not probes:
        return None
    return ContainerProbes(container, probes).start()


class ContainerProbes:
    """The probes of one start of one container, each on a thread of its own until the process ends."""

    def __init__(self, container, probes: dict[str, dict]):
        self.c, self.probes = container, probes
        self.stopped = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(kind, probe), daemon=True, name=f"{container.pod.name}/{kind}")
            for kind, probe in probes.items()
        ]
        if "readinessProbe" in probes:
            container.ready = False  # not ready until the probe passes

    def start(self) -> ContainerProbes:
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        """The process ended: its probes stop (a restart is probed afresh)."""
        self.stopped.set()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(5)

    # ---- one probe
    def _run(self, kind: str, probe: dict) -> None:
        period = max(1, int(probe.get("periodSeconds", 10)))
        failures_needed = max(1, int(probe.get("failureThreshold", 3)))
        successes_needed = 1 if kind == "livenessProbe" else max(1, int(probe.get("successThreshold", 1)))
        successes = failures = 0
        if self.stopped.wait(int(probe.get("initialDelaySeconds", 0))):
            return
        while not self.stopped.is_set():
            why = self._get(probe["httpGet"], max(1, int(probe.get("timeoutSeconds", 1))))
            if self.stopped.is_set():
                return
            if why is None:
                successes, failures = successes + 1, 0
                if kind == "readinessProbe" and successes >= successes_needed and not self.c.ready:
                    self._set_ready(True)
            else:
                successes, failures = 0, failures + 1
                self._event("Unhealthy", f"{KINDS[kind]} probe failed: {why}")
                if failures >= failures_needed:
                    if kind == "livenessProbe":
                        self._kill(probe)
                        return
                    if self.c.ready:
                        self._set_ready(False)
            if self.stopped.wait(period):
                return

    def _get(self, action: dict, timeout: int) -> str | None:
        """None when the GET succeeds, else why it failed (the kubelet's wording, near enough)."""
        port = action.get("port")
        if isinstance(port, str) and not port.isdigit():
            named = [p["containerPort"] for p in self.c.spec.get("ports") or [] if p.get("name") == port]
            if not named:
                return f'port "{port}" is not one of the container\'s ports'
            port = named[0]
        host = action.get("host") or self.c.pod.ip
        path = action.get("path") or "/"
        scheme = (action.get("scheme") or "HTTP").upper()
        url = f"{scheme.lower()}://{host}:{port}{path}"
        if scheme == "HTTPS":
            conn = http.client.HTTPSConnection(
                host, int(port), timeout=timeout, context=ssl._create_unverified_context()
            )
        else:
            conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        try:
            headers = {h["name"]: h["value"] for h in action.get("httpHeaders") or []}
            conn.request("GET", path, headers={"User-Agent": "kube-probe/1.34", **headers})
            status = conn.getresponse().status
        except TimeoutError:
            return f'Get "{url}": context deadline exceeded (Client.Timeout exceeded while awaiting headers)'
        except OSError as e:
            return f'Get "{url}": {e}'
        finally:
            conn.close()
        return None if 200 <= status < 400 else f"HTTP probe failed with statuscode: {status}"

    # ---- what a failed probe does
    def _set_ready(self, ready: bool) -> None:
        self.c.ready = ready
        self.c.pod.k.log.info("%s: %s: ready=%s (readiness probe)", self.c.pod.ref, self.c.name, ready)
        self.c.pod.publish()

    def _kill(self, probe: dict) -> None:
        """SIGTERM the container (its init passes it on), SIGKILL its processes after the grace period."""
        c, k = self.c, self.c.pod.k
        grace = probe.get("terminationGracePeriodSeconds")
        if grace is None:
            grace = c.pod.pod["spec"].get("terminationGracePeriodSeconds", 30)
        self._event("Killing", f"Container {c.name} failed liveness probe, will be restarted", kind="Normal")
        k.log.info("%s: %s: liveness probe failed, killing it (grace %ss)", c.pod.ref, c.name, grace)
        proc = c.proc
        if proc is None:
            return
        init = namespace_init(proc.pid)
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(init, signal.SIGTERM)
        deadline = time.monotonic() + int(grace)
        while proc.returncode is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if proc.returncode is None:
            k.log.info("%s: %s: grace period over, SIGKILL", c.pod.ref, c.name)
            c.kill()

    def _event(self, reason: str, message: str, kind: str = "Warning") -> None:
        pod, k = self.c.pod, self.c.pod.k
        k.log.info("%s: %s: %s: %s", pod.ref, self.c.name, reason, message)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        event = {
            "metadata": {"generateName": f"{pod.pod_name}.", "namespace": pod.namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod.pod_name,
                "namespace": pod.namespace,
                "uid": pod.uid,
                "fieldPath": f"spec.containers{{{self.c.name}}}",
            },
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": "kubelet", "host": k.name},
            "reportingComponent": "kubelet",
            "reportingInstance": k.name,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            k.core.create_namespaced_event(pod.namespace, event)
        except k.ApiException as e:
            k.log.warning("%s: event %s not recorded: %s", pod.ref, reason, e.status)
