"""Progress for people: a redrawn bar on a terminal, periodic plain lines in logs."""

from __future__ import annotations

import io

from elastic_step.master.progress import Progress

SAMPLE = {"epoch": 1, "records": 1500, "records_per_s": 812.4, "loss": 0.4321, "workers_alive": 2}


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_gets_a_redrawn_bar_with_the_figures():
    out = Tty()
    p = Progress("auto", records_per_epoch=1000, epochs=2, stream=out)
    p.show(SAMPLE)
    p.show({**SAMPLE, "records": 2000, "epoch": 1}, final=True)
    text = out.getvalue()
    assert text.startswith("\r[") and text.endswith("\n")
    for piece in ("epoch 2/2", "812 rec/s", "workers 2", "loss 0.4321", "100.0%"):
        assert piece in text


def test_logs_get_plain_lines_not_more_than_every_few_seconds():
    out = io.StringIO()
    p = Progress("auto", records_per_epoch=1000, epochs=2, stream=out)
    p.show(SAMPLE, now=100.0)
    p.show(SAMPLE, now=104.9)  # too soon: no second line
    p.show(SAMPLE, final=True, now=105.0)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(l.startswith("progress: epoch 2/2") for l in lines)
    assert "\r" not in out.getvalue()


def test_rate_is_over_a_recent_window():
    p = Progress("off", records_per_epoch=1000, epochs=1, stream=io.StringIO())
    assert p.rate(0, now=100.0) == 0.0
    assert p.rate(1000, now=101.0) == 1000.0
    assert p.rate(1000, now=120.0) < 100.0  # the old samples left the window
