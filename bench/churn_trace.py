"""bench/churn.py's trace, the same on every side and either backend, and the job every side trains: which worker is
preempted at which share of the job's records (a seeded Poisson process per worker in training time), and which of
its points fire once a side has trained so many records."""

from __future__ import annotations

import pathlib
import random

from bench.common import summary

SIDES = ("ps", "allreduce", "mwms", "psstrategy", "fit")
CHURN_MINUTES = {"none": None, "moderate": 10.0, "heavy": 2.0}  # training minutes between a worker's preemptions
MINIBATCH = 64  # per worker
MODEL = "samples/digits/model.py"


def trace(churn: str, workers: int, job_minutes: float, seed: int) -> list[tuple[int, float]]:
    """(worker, share of the job's records) of every preemption, in order: Poisson per worker in training time."""
    every = CHURN_MINUTES[churn]
    if every is None:
        return []
    rng = random.Random(seed)
    points = []
    for w in range(workers):
        t = rng.expovariate(1.0 / every)
        while t < job_minutes:
            points.append((w, t / job_minutes))
            t += rng.expovariate(1.0 / every)
    return sorted(points, key=lambda p: p[1])


def at_records(points: list[tuple[int, float]], total: int) -> list[tuple[int, int]]:
    return [(w, max(1, int(share * total))) for w, share in points]


def points_due(pending: list[tuple[int, int]], records: int, down: set[int]) -> list[tuple[int, int]]:
    """The trace's points (worker, records) that fire at `records`, in order: reached, and their worker up. A point
    whose worker is down waits for it, alone; a worker shot here is down for its later points."""
    due, shot = [], set(down)
    for w, at in pending:
        if at <= records and w not in shot:
            due.append((w, at))
            shot.add(w)
    return due


def elastic_figures(out: pathlib.Path, wall: float) -> dict:
    """An elastic-step run's figures, from the summary.json it wrote to `out`: its time to target (`wall`), accuracy,
    records trained again and audit by its ledger, and the preemptions its own chaos fired (the local trace's)."""
    s = summary(out)
    return {
        "time_to_target_s": wall,
        "accuracy": s["eval"].get("accuracy"),
        "records_trained_again": s["ledger"]["records_trained_again"],
        "fired_at": [f["at_records"] for f in s.get("chaos", {}).get("fired", [])],
        "audit": s.get("audit", {}).get("verdict", "no PS"),
    }
