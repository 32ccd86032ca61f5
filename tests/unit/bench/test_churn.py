"""bench/churn.py's trace (one seeded Poisson process per worker, the same on every side, its rates ordered), its
figures per side and its plots."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from bench.churn import claims, figures, plot
from bench.churn_trace import at_records, points_due, trace


def test_a_seed_draws_one_trace_and_no_churn_draws_none():
    assert trace("heavy", 2, 20.0, seed=1) == trace("heavy", 2, 20.0, seed=1)
    assert trace("heavy", 2, 20.0, seed=1) != trace("heavy", 2, 20.0, seed=2)
    assert trace("none", 2, 20.0, seed=1) == []


def test_heavy_churn_preempts_about_five_times_as_often_as_moderate():
    moderate = sum(len(trace("moderate", 4, 60.0, seed=s)) for s in range(50))
    heavy = sum(len(trace("heavy", 4, 60.0, seed=s)) for s in range(50))
    # Poisson means over 50 traces of 4 workers x 60 minutes: 1,200 and 6,000
    assert moderate == pytest.approx(1200, rel=0.15)
    assert heavy == pytest.approx(6000, rel=0.1)


def test_the_trace_is_keyed_to_progress_in_order_within_the_job():
    points = trace("heavy", 3, 20.0, seed=0)
    shares = [share for _, share in points]
    assert shares == sorted(shares) and 0 < shares[0] and shares[-1] < 1
    assert {w for w, _ in points} <= {0, 1, 2}
    records = at_records(points, 10_000)
    assert [r for _, r in records] == sorted(r for _, r in records) and all(1 <= r < 10_000 for _, r in records)


def _run(side, churn, run, time_s, fired, due):
    return {
        "side": side,
        "churn": churn,
        "run": run,
        "time_to_target_s": time_s,
        "accuracy": 0.97,
        "records_trained_again": 0,
        "fired_at": list(range(fired)),
        "preemptions": fired,
        "trace": due,
        "due": due,
    }


RUNS = [
    _run("ps", "none", 0, 10.0, 0, 0),
    _run("ps", "none", 1, 12.0, 0, 0),
    _run("ps", "heavy", 0, 20.0, 3, 3),
    _run("ps", "heavy", 1, 25.0, 2, 3),
    _run("psstrategy", "none", 0, 15.0, 0, 0),
    _run("psstrategy", "heavy", 0, None, 1, 3),  # stalled
]


def test_goodput_is_the_sides_best_time_without_churn_over_each_runs_and_a_short_fired_count_is_flagged():
    rows = {(f["churn"], f["side"]): f for f in figures(RUNS)}
    assert list(rows) == [("none", "ps"), ("none", "psstrategy"), ("heavy", "ps"), ("heavy", "psstrategy")]
    heavy = rows["heavy", "ps"]
    assert (heavy["time_best"], heavy["time_worst"]) == (20.0, 25.0)
    assert (heavy["goodput_best"], heavy["goodput_worst"]) == (0.5, 0.4)
    assert heavy["fired_differs"] and heavy["fired"] == "3/3 2/3"
    assert not rows["none", "ps"]["fired_differs"] and rows["none", "ps"]["goodput_best"] == 1.0
    assert rows["heavy", "psstrategy"]["stalled"] == 1 and "time_best" not in rows["heavy", "psstrategy"]


def test_a_run_that_failed_for_good_is_told_from_one_past_the_budget(tmp_path):
    failed = {**_run("fit", "heavy", 0, None, 2, 3), "stalled": True, "failed": "OSError: truncated file"}
    runs = [*RUNS, _run("fit", "none", 0, 8.0, 0, 0), failed]
    rows = {(f["churn"], f["side"]): f for f in figures(runs)}
    assert (rows["heavy", "fit"]["stalled"], rows["heavy", "fit"]["failed"]) == (1, 1)
    assert (rows["heavy", "psstrategy"]["stalled"], rows["heavy", "psstrategy"]["failed"]) == (1, 0)
    texts = [
        t.text for t in ET.parse(plot(runs, tmp_path / "churn")[1]).getroot().iter("{http://www.w3.org/2000/svg}text")
    ]
    assert "failed" in texts and "stalled" in texts


def test_one_svg_a_churn_rate_with_a_bar_a_side_in_each_panel(tmp_path):
    paths = plot(RUNS, tmp_path / "churn")
    assert [p.name for p in paths] == ["churn-none.svg", "churn-heavy.svg"]
    heavy = ET.parse(paths[1]).getroot()  # well-formed SVG
    texts = [t.text for t in heavy.iter("{http://www.w3.org/2000/svg}text")]
    assert texts.count("ps") == texts.count("psstrategy") == 2  # goodput and time to target
    assert "stalled" in texts and "5/6 !" in texts  # fired/due over its runs
    assert len(list(heavy.iter("{http://www.w3.org/2000/svg}rect"))) == 1 + 2  # the page, ps's two bars


def test_a_point_whose_worker_is_down_waits_for_it_alone_and_a_worker_is_shot_once_a_pass():
    pending = [(0, 100), (1, 150), (0, 180), (1, 400)]
    assert points_due(pending, 90, set()) == []
    assert points_due(pending, 200, set()) == [(0, 100), (1, 150)]  # worker 0's later point waits for its restart
    assert points_due(pending, 200, {0}) == [(1, 150)]  # worker 0 is down: its points wait, worker 1's do not
    assert points_due(pending, 500, {1}) == [(0, 100)]


def test_the_claims_under_churn_are_checked_best_against_best_and_a_missed_one_is_said():
    runs = [
        _run("ps", "none", 0, 10.0, 0, 0),
        _run("ps", "moderate", 0, 11.0, 1, 1),  # 1.1x its own time, goodput 0.91
        _run("ps", "heavy", 0, 20.0, 5, 5),  # goodput 0.5
        _run("mwms", "none", 0, 12.0, 0, 0),
        _run("mwms", "moderate", 0, 15.0, 1, 1),  # ps takes 0.73x its time: more than 0.7x
        _run("mwms", "heavy", 0, 40.0, 5, 5),  # goodput 0.3: ps's is 1.67x it
    ]
    verdict = {(c["side"], c["claim"]): c["holds"] for c in claims(runs)}
    assert verdict == {
        ("ps", "moderate: time / own time without churn <= 1.2"): True,
        ("ps", "moderate: goodput >= 0.9"): True,
        ("ps", "moderate: time / mwms's <= 0.7"): False,
        ("ps", "moderate: accuracy - mwms's >= 0"): True,
        ("ps", "heavy: goodput / mwms's >= 2"): False,
    }  # and nothing for allreduce, which has no runs


def test_where_every_mwms_run_stalled_its_budget_bounds_the_claims_against_it(tmp_path):
    def stalled(churn, run, at_s):
        return {**_run("mwms", churn, run, None, 3, 3), "stalled": True, "stalled_at_s": at_s}

    runs = [
        _run("ps", "none", 0, 10.0, 0, 0),
        _run("ps", "moderate", 0, 11.0, 1, 1),
        _run("ps", "heavy", 0, 20.0, 5, 5),  # goodput 0.5
        {**_run("mwms", "none", 0, 30.0, 0, 0), "accuracy": 0.98},
        stalled("moderate", 0, 601.0),
        stalled("heavy", 0, 640.0),
        stalled("heavy", 1, 602.0),  # its best took more than 602 s: goodput under 30/602
    ]
    rows = {(f["churn"], f["side"]): f for f in figures(runs)}
    assert rows["heavy", "mwms"]["time_over"] == 602.0
    assert rows["heavy", "mwms"]["goodput_under"] == pytest.approx(30 / 602)
    got = {c["claim"]: (round(c["value"], 4), c["bounded"], c["holds"]) for c in claims(runs) if c["side"] == "ps"}
    assert got["moderate: time / mwms's <= 0.7"] == (round(11 / 601, 4), "<", True)
    assert got["heavy: goodput / mwms's >= 2"] == (round(0.5 / (30 / 602), 4), ">", True)
    # mwms's churned runs have no accuracy: ps's is held against mwms's without churn, and is 0.01 below it
    assert got["moderate: accuracy - mwms's without churn >= 0"] == (-0.01, None, False)
    texts = [
        t.text for t in ET.parse(plot(runs, tmp_path / "churn")[2]).getroot().iter("{http://www.w3.org/2000/svg}text")
    ]
    assert "stalled > 602 s" in texts
