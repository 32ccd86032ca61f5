"""The step's own liveness: HTTP ``GET /healthz`` on the master, for Kubernetes' liveness probe.

The master's pump (master/job.py) turns several times a second for the whole of training: it
handles the backend's events, cuts checkpoints and fires relaunches. A master whose pump has stopped
turning (a deadlock, a call that never returns) leaves its job stalled for good while the step's pod
looks alive; the probe sees it and Kubernetes ends the container, so the step is retried and the job
resumes from its last checkpoint. The answer is 200 while the pump has turned within a bound, 503 with
a one-line reason once it has not. Work that stops the pump on purpose (start-up, a checkpoint's write,
a restore, the final evaluation and the model's save and upload) is declared with ``busy``: it answers
200 and says what it is and for how long, since it is bounded by its own timeouts (the store's, the
RPCs'), not by the pump's. A process frozen whole (SIGSTOP, a node cut off) does not answer at all,
which the probe counts as a failure too.

Served by its own thread, as the input server is (master/input_server.py), so a stalled pump cannot
stall the answer. The same port serves ``GET /metrics`` (master/observe/metrics.py) when the step passes it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from elastic_step.errors import ConfigError

log = logging.getLogger("elastic_step.master")

PATH = "/healthz"
METRICS_PATH = "/metrics"
FINAL_SCRAPE_MAX_S = 30.0  # the longest the step's end waits for a scraper to read its final figures
POD_PORT = 8080  # --health-port -1 (the default) in a pod; the Argo template's probe asks this port
# The master's pod, as a Prometheus that scrapes annotated pods or a PodMonitor finds it (the Argo template and the
# KFP pipeline put them on the training step's pod; docs/observability.md)
SCRAPE_LABELS = {"app.kubernetes.io/name": "elastic-step", "app.kubernetes.io/component": "master"}
SCRAPE_ANNOTATIONS = {
    "prometheus.io/scrape": "true",
    "prometheus.io/port": str(POD_PORT),
    "prometheus.io/path": METRICS_PATH,
}
Metrics = Callable[[], tuple[bytes, str]]  # a scrape's text and its content type
PUMP_BOUND_S = 30.0  # the pump turns every 0.1 s: 30 s without a turn is a stall, not a busy turn


class Health:
    """What ``/healthz`` answers: the pump's last turn, or the busy work that holds it."""

    def __init__(self, bound_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.bound_s = PUMP_BOUND_S if bound_s is None else bound_s
        self._clock = clock
        self._started = clock()
        self._last_turn: float | None = None
        self._busy: list[tuple[str, float]] = []  # nested: the innermost says what the master is doing

    def turned(self) -> None:
        """A turn of the pump."""
        self._last_turn = self._clock()

    @contextlib.contextmanager
    def busy(self, what: str) -> Iterator[None]:
        """Work that holds the pump on purpose (``what``: for a person, e.g. "cutting a checkpoint")."""
        self._busy.append((what, self._clock()))
        try:
            yield
        finally:
            self._busy.pop()
            self._last_turn = self._clock()  # the bound counts from the end of the work, not from before it

    def check(self) -> tuple[bool, str]:
        """(alive, a one-line reason)."""
        now, busy, last = self._clock(), list(self._busy), self._last_turn
        if busy:
            what, since = busy[-1]
            return True, f"busy {what} for {now - since:.0f} s"
        if last is None:
            return True, f"starting for {now - self._started:.0f} s"
        quiet = now - last
        if quiet > self.bound_s:
            return False, f"the master's pump has not turned for {quiet:.0f} s (bound {self.bound_s:.0f} s)"
        return True, f"ok: the master's pump turned {quiet:.1f} s ago"


class HealthServer:
    """``health`` served at ``GET /healthz`` on ``port`` (0: a free port, for tests) by a daemon thread, and
    ``metrics()`` (the text of a scrape and its content type) at ``GET /metrics``."""

    def __init__(self, health: Health, port: int, bind_host: str = "0.0.0.0", metrics: Metrics | None = None):
        self.health = health
        self._scrapes = threading.Condition()
        self._scraped_at: list[float] = []  # when the last scrapes of /metrics began (monotonic), the newest last
        self._httpd = ThreadingHTTPServer((bind_host, port), _handler(health, metrics, self._scraped))
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.1,), name="health-server", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._final_scrape()
        self._httpd.shutdown()
        self._httpd.server_close()

    def _scraped(self, began: float) -> None:
        with self._scrapes:
            self._scraped_at = [*self._scraped_at[-1:], began]
            self._scrapes.notify_all()

    def _final_scrape(self) -> None:
        """A scraper that has been reading /metrics reads the step's final figures before the endpoint goes: its next
        scrape that begins now or later is waited for, at most two of its intervals (and FINAL_SCRAPE_MAX_S)."""
        with self._scrapes:
            if len(self._scraped_at) < 2:
                return
            now = time.monotonic()
            interval = self._scraped_at[-1] - self._scraped_at[-2]
            deadline = now + min(2 * interval + 5.0, FINAL_SCRAPE_MAX_S)
            while self._scraped_at[-1] < now and (left := deadline - time.monotonic()) > 0:
                self._scrapes.wait(left)


def resolve_port(health_port: int, in_pod: bool) -> int:
    """The port --health-port asks for: -1 is POD_PORT in a pod, else off (0)."""
    if health_port == -1:
        return POD_PORT if in_pod else 0
    return health_port


@contextlib.contextmanager
def serving(
    health_port: int, in_pod: bool, bind_host: str = "0.0.0.0", metrics: Metrics | None = None
) -> Iterator[Health]:
    """A Health for the step, served for as long as the block runs when --health-port asks for it. A port
    asked for explicitly that cannot be bound is bad input; the default's, a warning (the step trains
    without the endpoint: a probe that asks it fails, and says why in the pod's events)."""
    health, port, server = Health(), resolve_port(health_port, in_pod), None
    if port:
        try:
            server = HealthServer(health, port, bind_host, metrics)
        except OSError as e:
            if health_port != -1:
                raise ConfigError(
                    f"--health-port {port}: cannot serve the master's health endpoint there ({e.strerror}). "
                    "Pass a free port, or 0 for none."
                ) from None
            log.warning("no health endpoint: port %d cannot be bound (%s)", port, e.strerror)
        else:
            log.info("health endpoint: GET http://%s:%d%s", bind_host, server.port, PATH)
            if metrics is not None:
                log.info("metrics: GET http://%s:%d%s (Prometheus)", bind_host, server.port, METRICS_PATH)
    try:
        yield health
    finally:
        if server is not None:
            server.stop()


def _handler(health: Health, metrics: Metrics | None, scraped: Callable[[float], None]):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path == METRICS_PATH and metrics is not None:
                began = time.monotonic()
                body, content_type = metrics()
                self._send(200, body, content_type)
                return scraped(began)
            if path != PATH:
                return self._answer(404, "not found: the health endpoint is " + PATH)
            alive, reason = health.check()
            self._answer(200 if alive else 503, reason)

        def _answer(self, status: int, text: str) -> None:
            self._send(status, (text + "\n").encode(), "text/plain; charset=utf-8")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args):  # a probe every few seconds: not for the step's log
            pass

    return Handler
