"""The exactly-once audit: what the model's state holds, compared with the data set.

The ledger is what the master believes; the audit is the check on it. Whoever holds the model's
state accounts for the records of each update it applied (data/accounting.py, AppliedRecords): every PS
shard for its pushes; in allreduce, every member for each step it applied, all members'
contributions included (they travel in the allreduced buffer, and with the weights to a newcomer).
Here those ranges are laid over the training manifest: per epoch, how many records were applied 0,
1 and more than 1 times. Nothing here reads the ledger. A record counts as applied once only when
every holder applied it exactly once: a push lost on one shard, or applied twice on one, leaves the
shards' parameters out of step with the data, whatever the other shards hold.

With --skip-non-finite, a minibatch whose loss or gradient was not finite is skipped, not applied, and
its holders account for it as such (AppliedRecords.skip). A record skipped once and never applied
counts as skipped; one both skipped and applied, or skipped twice, as more than once. Exactly-once
then means: every record applied once or skipped once.
"""

from __future__ import annotations

import numpy as np

from elastic_step.data.accounting import skipped_key

EXACT, VIOLATED, UNAVAILABLE = "exact", "violated", "unavailable"


def coverage(rows: int, ranges: np.ndarray) -> np.ndarray:
    """How many times each of a data shard's `rows` records is covered by the [start, end) ranges.
    Records outside the shard are not counted here (see `audit`: they are a violation of their own)."""
    ranges = np.clip(np.asarray(ranges, dtype=np.int64).reshape(-1, 2), 0, rows)
    delta = np.zeros(rows + 1, np.int64)
    np.add.at(delta, ranges[:, 0], 1)
    np.add.at(delta, ranges[:, 1], -1)
    return np.cumsum(delta[:-1])


def audit(
    shard_rows: list[int], epochs: int, evidence: list[dict[tuple[int, int], np.ndarray]], source: str = "ps"
) -> dict:
    """`shard_rows`: records of each data shard of the training manifest, in manifest order.
    `evidence`: per holder of state (PS shard, or the allreduce member the model came from),
    (epoch, data shard) -> the [start, end) ranges it applied. `source`: "ps" or "allreduce".
    Returns the audit for summary.json: a verdict and, per epoch, records applied 0, 1, >1 times."""
    if not evidence:
        return {"source": source, "verdict": UNAVAILABLE, "reason": "no evidence from the model's state", "epochs": []}
    records = int(sum(shard_rows))
    none = np.zeros((0, 2), np.int64)
    per_epoch, strays = [], 0
    for epoch in range(epochs):
        never = once = skipped = more = disagree = 0
        for index, rows in enumerate(shard_rows):
            # Per holder and record: applied + skipped (how many times it was accounted for), and skipped.
            applied = np.stack([coverage(rows, shard.get((epoch, index), none)) for shard in evidence])
            skips = np.stack([coverage(rows, shard.get(skipped_key(epoch, index), none)) for shard in evidence])
            total = applied + skips
            agreed = (total.min(axis=0) == total.max(axis=0)) & (skips.min(axis=0) == skips.max(axis=0))
            total, skips = total[0], skips[0]
            disagree += int((~agreed).sum())
            never += int((agreed & (total == 0)).sum())
            once += int((agreed & (total == 1) & (skips == 0)).sum())
            skipped += int((agreed & (total == 1) & (skips == 1)).sum())
            more += int((agreed & (total > 1)).sum())
        per_epoch.append(
            {
                "epoch": epoch,
                "records": records,
                "applied_once": once,
                **({"skipped": skipped} if skipped else {}),
                "never": never,
                "more_than_once": more,
                "shards_disagree": disagree,
            }
        )
    # Anything applied that is not a record of an epoch and shard of this data set.
    for shard in evidence:
        for (epoch, index), ranges in shard.items():
            index = skipped_key(epoch, index)[1] if index < 0 else index
            ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
            rows = shard_rows[index] if 0 <= index < len(shard_rows) and 0 <= epoch < epochs else 0
            strays += int(
                (np.clip(ranges[:, 1], rows, None) - np.clip(ranges[:, 0], rows, None)).sum()
                + (np.clip(ranges[:, 1], None, 0) - np.clip(ranges[:, 0], None, 0)).sum()
            )
    exact = strays == 0 and all(e["applied_once"] + e.get("skipped", 0) == records for e in per_epoch)
    return {
        "source": source,
        "holders": len(evidence),
        "where": where(source, len(evidence)),
        "verdict": EXACT if exact else VIOLATED,
        "records_outside_the_data": strays,
        "epochs": per_epoch,
    }


def describe(result: dict) -> str:
    """One line for a person: the verdict, and where it fails."""
    if result["verdict"] == UNAVAILABLE:
        return f"audit unavailable ({result.get('reason', 'no evidence')})"
    if result["verdict"] == EXACT:
        n = len(result["epochs"])
        skipped = sum(e.get("skipped", 0) for e in result["epochs"])
        if skipped:
            return (
                f"audit exact: every record of {n} epoch(s) applied exactly once or skipped once ({skipped} skipped "
                f"as not finite), {result['where']}"
            )
        return f"audit exact: every record of {n} epoch(s) applied exactly once, {result['where']}"
    bad = [e for e in result["epochs"] if e["applied_once"] + e.get("skipped", 0) != e["records"]]
    parts = [
        f"epoch {e['epoch']}: {e['never']} never, {e['more_than_once']} more than once, "
        f"{e['shards_disagree']} differing between shards"
        for e in bad[:3]
    ]
    if result.get("records_outside_the_data"):
        parts.append(f"{result['records_outside_the_data']} applied records outside the data set")
    return "audit VIOLATED: " + "; ".join(parts)


def where(source: str, holders: int) -> str:
    """Where the evidence came from, for a person."""
    if source == "allreduce":
        return "by the final weights' own accounting (allreduce members)"
    return f"on all {holders} PS shard(s)"
