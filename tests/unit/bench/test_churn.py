"""bench/churn.py's trace: one seeded Poisson process per worker, the same on every side, its rates ordered."""

from __future__ import annotations

import pytest

from bench.churn import at_records, trace


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
