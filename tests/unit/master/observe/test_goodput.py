"""Goodput: where the step's wall time and worker-seconds go, on a clock the test moves."""

from __future__ import annotations

import pytest

from elastic_step.master.observe.goodput import CAUSES, TRAINING, Goodput, describe


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_each_interval_goes_to_what_the_master_did_over_it_and_busy_work_to_its_cause():
    clock = Clock()
    g = Goodput(clock)
    clock.now += 10  # start-up: two workers launched, none training
    g.now_doing(TRAINING, workers=2, training=2)
    clock.now += 60  # training
    with g.doing("checkpoint"):  # a write that stops the pump
        clock.now += 5
    g.now_doing("waiting", workers=2, training=0)
    clock.now += 5
    g.now_doing(TRAINING, workers=2, training=1)  # one worker trains, one is still pending
    clock.now += 20
    f = g.figures(committed=1000, trained_again=0)
    assert f["wall_s"] == {
        TRAINING: 80.0,
        "startup": 10.0,
        "waiting": 5.0,
        "rewind": 0.0,
        "checkpoint": 5.0,
        "restore": 0.0,
        "evaluation": 0.0,
        "finishing": 0.0,
    }
    # worker-seconds: start-up's workers were not counted yet (none launched at the first call)
    assert f["worker_s"][TRAINING] == 2 * 60 + 1 * 20
    assert f["worker_s"]["waiting"] == 2 * 5 + 1 * 20
    assert f["worker_s"]["checkpoint"] == 2 * 5
    assert f["ratio"] == pytest.approx(80 / 100)
    assert f["worker_ratio"] == pytest.approx(140 / 180, abs=1e-4)


def test_records_trained_again_take_their_share_of_training_as_rewind():
    clock = Clock()
    g = Goodput(clock)
    g.now_doing(TRAINING, workers=1, training=1)
    clock.now += 100
    f = g.figures(committed=750, trained_again=250)  # a quarter of what was trained was trained again
    assert f["wall_s"][TRAINING] == pytest.approx(75) and f["wall_s"]["rewind"] == pytest.approx(25)
    assert f["ratio"] == pytest.approx(0.75)
    assert describe(f) == "goodput 75 % of wall time (75 % of worker-seconds); lost to training again 25 %"


def test_reading_the_figures_changes_nothing():
    clock = Clock()
    g = Goodput(clock)
    g.now_doing(TRAINING, workers=1, training=1)
    clock.now += 10
    first = g.figures(100, 0)
    clock.now += 10
    assert g.figures(100, 0)["wall_s"][TRAINING] == first["wall_s"][TRAINING] + 10
    assert set(first["wall_s"]) == {TRAINING, *CAUSES}
