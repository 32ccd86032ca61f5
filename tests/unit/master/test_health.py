"""The step's health endpoint: what it answers for a pump that turns, a pump that stalled, and work that holds
the pump on purpose (a clock the test moves), over real HTTP; and which port --health-port serves."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request

import pytest

from elastic_step.errors import ConfigError
from elastic_step.master.health import PATH, POD_PORT, Health, HealthServer, resolve_port, serving


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def get(port: int, path: str = PATH) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_alive_while_the_pump_turns_within_the_bound_and_not_after():
    clock = Clock()
    h = Health(bound_s=30, clock=clock)
    assert h.check() == (True, "starting for 0 s")  # before the first turn: the job is being set up
    h.turned()
    clock.now += 30
    assert h.check()[0]  # at the bound: still alive
    clock.now += 11
    assert h.check() == (False, "the master's pump has not turned for 41 s (bound 30 s)")
    h.turned()
    assert h.check() == (True, "ok: the master's pump turned 0.0 s ago")


def test_busy_work_is_alive_however_long_and_the_bound_counts_from_its_end():
    clock = Clock()
    h = Health(bound_s=30, clock=clock)
    h.turned()
    with h.busy("cutting a checkpoint"):
        clock.now += 600
        assert h.check() == (True, "busy cutting a checkpoint for 600 s")
        with h.busy("restoring the parameter servers"):  # the innermost says what the master does
            clock.now += 5
            assert h.check() == (True, "busy restoring the parameter servers for 5 s")
        assert h.check() == (True, "busy cutting a checkpoint for 605 s")
    clock.now += 29
    assert h.check()[0]  # 29 s after the work ended, not 634 s after the last turn
    clock.now += 2
    assert not h.check()[0]


def test_the_endpoint_answers_200_then_503_with_the_reason_over_http():
    clock = Clock()
    h = Health(bound_s=30, clock=clock)
    server = HealthServer(h, 0, "127.0.0.1")
    try:
        h.turned()
        assert get(server.port) == (200, "ok: the master's pump turned 0.0 s ago\n")
        clock.now += 45
        assert get(server.port) == (503, "the master's pump has not turned for 45 s (bound 30 s)\n")
        assert get(server.port, "/other")[0] == 404
    finally:
        server.stop()


def test_the_port_asked_for():
    assert resolve_port(-1, in_pod=True) == POD_PORT
    assert resolve_port(-1, in_pod=False) == 0  # a local run serves nothing unless asked
    assert resolve_port(0, in_pod=True) == 0
    assert resolve_port(9001, in_pod=False) == 9001


def test_a_port_asked_for_that_is_taken_is_bad_input():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--health-port {port}: cannot serve"):
            with serving(port, in_pod=False, bind_host="127.0.0.1"):
                pass


def test_served_only_for_the_block():
    with socket.socket() as s:  # a port free now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with serving(port, in_pod=False, bind_host="127.0.0.1") as h:
        h.turned()
        assert get(port)[0] == 200
    with pytest.raises(urllib.error.URLError):
        get(port)


def test_a_scraper_reads_the_final_figures_before_the_endpoint_goes():
    figures = {"records": 1}
    server = HealthServer(
        Health(), 0, "127.0.0.1", metrics=lambda: (f"records {figures['records']}\n".encode(), "text/plain")
    )
    url = f"http://127.0.0.1:{server.port}/metrics"
    seen: list[bytes] = []

    def scrape() -> None:
        seen.append(urllib.request.urlopen(url, timeout=5).read())

    scrape()
    scrape()  # a scraper every few milliseconds
    figures["records"] = 2  # the step's end: its final figures
    stopping = threading.Thread(target=server.stop)
    stopping.start()
    stopping.join(0.2)
    assert stopping.is_alive()  # the endpoint waits for the scraper's next read
    scrape()
    stopping.join(5)
    assert not stopping.is_alive() and seen[-1] == b"records 2\n"


def test_without_a_scraper_the_endpoint_goes_at_once():
    server = HealthServer(Health(), 0, "127.0.0.1", metrics=lambda: (b"", "text/plain"))
    stopping = threading.Thread(target=server.stop)
    stopping.start()
    stopping.join(2)
    assert not stopping.is_alive()
