"""Witnesses of exactly-once that owe nothing to the ledger: the tally model's trained weights and the
PS shards' audit; and the check that a test's chaos really fired."""

from __future__ import annotations

import os

import fsspec
import numpy as np
import pyarrow.parquet as pq

from elastic_step.data.manifest import load_manifest
from tests.models import tally

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TALLY_MODEL = os.path.join(ROOT, "tests", "models", "tally.py")


def prepare_tally_data(out) -> dict:
    """The tally data set (one record per id), prepared into train and eval manifests under `out`."""
    from elastic_step.data.prep import prepare

    tally.write_csv(str(out / "tally.csv"))
    r = prepare(str(out / "tally.csv"), str(out / "prepared"), label="label", seed=0)
    return {"train": r.train_uri, "eval": r.eval_uri, "rows": r.train.total_rows}


def train_ids(manifest_uri: str) -> np.ndarray:
    m = load_manifest(manifest_uri)
    ids = []
    for s in m.shards:
        with fsspec.open(m.shard_uri(s), "rb") as f:  # any store, as the step reads it
            ids.append(pq.read_table(f, columns=["id"])["id"].to_numpy())
    return np.concatenate(ids)


def assert_chaos_fired(summary: dict, planned: int) -> list[dict]:
    chaos = summary.get("chaos") or {}
    fired = chaos.get("fired", [])
    assert len(fired) == planned, (
        f"the chaos never fired as planned: {len(fired)} of {planned} signals sent "
        f"(not fired: {chaos.get('not_fired')}); the test proved nothing"
    )
    return fired


def assert_each_record_applied_exactly(out, data: dict, epochs: int) -> None:
    """The weights count applications: `epochs` for every train record, 0 for every other id."""
    rows, dense = tally.tallies(str(out / "model.keras"))
    expected = np.zeros(tally.RECORDS)
    expected[train_ids(data["train"])] = epochs
    for name, got in (("embedding rows", rows), ("dense kernel", dense)):
        if got is None:  # the model without its table (tally.TABLE_ENV)
            continue
        wrong = np.nonzero(got != expected)[0]
        assert wrong.size == 0, (
            f"{name}: {wrong.size} records applied a wrong number of times, e.g. ids "
            f"{wrong[:10].tolist()} hold {got[wrong[:10]].tolist()} (expected "
            f"{expected[wrong[:10]].tolist()})"
        )


def assert_audit_exact(summary: dict, source: str = "ps") -> None:
    """The audit: the model state's own accounting (PS shards, or allreduce members) over the data set."""
    audit = summary["audit"]
    assert audit["source"] == source and audit["verdict"] == "exact", audit
    assert [e["applied_once"] for e in audit["epochs"]] == [summary["records_per_epoch"]] * summary["epochs"]


def assert_exactly_once(summary: dict) -> None:
    """The job succeeded and every record of every epoch was applied exactly once, by the audit (the
    model state's own accounting laid over the data set), with the ledger agreeing with it."""
    assert summary["status"] == "succeeded", summary.get("status")
    assert_audit_exact(summary, summary["strategy"])
    applied = [e["applied_once"] for e in summary["audit"]["epochs"]]
    assert [e["committed"] for e in summary["ledger"]["epochs"]] == applied, summary["ledger"]["epochs"]
    assert all(e["double_applied"] == 0 for e in summary["ledger"]["epochs"])
