"""The exactly-once audit: what the parameter servers applied, compared with the data set.

The ledger is what the master believes; the audit is the check on it. Every PS shard accounts for
the records of each push it applied (ps/api.py, AppliedRecords), and here those ranges are laid
over the training manifest: per epoch, how many records were applied 0, 1 and more than 1 times.
Nothing here reads the ledger. A record counts as applied once only when every shard applied it
exactly once: a push lost on one shard, or applied twice on one, leaves the shards' parameters out
of step with the data, whatever the other shards hold.
"""
from __future__ import annotations

import numpy as np

EXACT, VIOLATED, UNAVAILABLE = "exact", "violated", "unavailable"


def coverage(rows: int, ranges: np.ndarray) -> np.ndarray:
    """How many times each of a data shard's `rows` records is covered by the [start, end) ranges.
    Records outside the shard are not counted here (see `audit`: they are a violation of their own)."""
    ranges = np.clip(np.asarray(ranges, dtype=np.int64).reshape(-1, 2), 0, rows)
    delta = np.zeros(rows + 1, np.int64)
    np.add.at(delta, ranges[:, 0], 1)
    np.add.at(delta, ranges[:, 1], -1)
    return np.cumsum(delta[:-1])


def audit(shard_rows: list[int], epochs: int, evidence: list[dict[tuple[int, int], np.ndarray]]) -> dict:
    """`shard_rows`: records of each data shard of the training manifest, in manifest order.
    `evidence`: per PS shard, (epoch, data shard) -> the [start, end) ranges it applied.
    Returns the audit for summary.json: a verdict and, per epoch, records applied 0, 1, >1 times."""
    if not evidence:
        return {"source": "ps", "verdict": UNAVAILABLE, "reason": "no parameter-server evidence", "epochs": []}
    records = int(sum(shard_rows))
    per_epoch, strays = [], 0
    for epoch in range(epochs):
        never = once = more = disagree = 0
        for index, rows in enumerate(shard_rows):
            counts = np.stack([coverage(rows, shard.get((epoch, index), np.zeros((0, 2), np.int64)))
                               for shard in evidence])
            lo, hi = counts.min(axis=0), counts.max(axis=0)
            agreed = lo == hi
            disagree += int((~agreed).sum())
            never += int((agreed & (lo == 0)).sum())
            once += int((agreed & (lo == 1)).sum())
            more += int((agreed & (lo > 1)).sum())
        per_epoch.append({"epoch": epoch, "records": records, "applied_once": once, "never": never,
                          "more_than_once": more, "shards_disagree": disagree})
    # Anything applied that is not a record of an epoch and shard of this data set.
    for shard in evidence:
        for (epoch, index), ranges in shard.items():
            ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
            rows = shard_rows[index] if 0 <= index < len(shard_rows) and 0 <= epoch < epochs else 0
            strays += int((np.clip(ranges[:, 1], rows, None) - np.clip(ranges[:, 0], rows, None)).sum()
                          + (np.clip(ranges[:, 1], None, 0) - np.clip(ranges[:, 0], None, 0)).sum())
    exact = strays == 0 and all(e["applied_once"] == records for e in per_epoch)
    return {"source": "ps", "ps_shards": len(evidence), "verdict": EXACT if exact else VIOLATED,
            "records_outside_the_data": strays, "epochs": per_epoch}


def describe(result: dict) -> str:
    """One line for a person: the verdict, and where it fails."""
    if result["verdict"] == UNAVAILABLE:
        return f"audit unavailable ({result.get('reason', 'no evidence')})"
    if result["verdict"] == EXACT:
        n = len(result["epochs"])
        return (f"audit exact: every record of {n} epoch(s) applied exactly once on all "
                f"{result.get('ps_shards', 1)} PS shard(s)")
    bad = [e for e in result["epochs"] if e["applied_once"] != e["records"]]
    parts = [f"epoch {e['epoch']}: {e['never']} never, {e['more_than_once']} more than once, "
             f"{e['shards_disagree']} differing between shards" for e in bad[:3]]
    if result.get("records_outside_the_data"):
        parts.append(f"{result['records_outside_the_data']} applied records outside the data set")
    return "audit VIOLATED: " + "; ".join(parts)
