"""Synthetic click-through data with high-cardinality id columns, for the wide-and-deep sample.

    python samples/ctr/generate.py OUT.csv --rows 20000 --seed 0

Columns: user_id, ad_id, site_id (integer ids below USER/AD/SITE_VOCAB), hour (0..23),
bid (a price), clicked (0/1). `clicked` is drawn from a hidden logistic model: an intercept,
a latent effect per site, ad and user, and smooth effects of bid and hour. Ids follow a
power law, as in real traffic, so popular ids repeat often enough for their effects to be
learnt; a model therefore beats the base rate within an epoch or two.
"""

from __future__ import annotations

import argparse
import csv

import numpy as np

USER_VOCAB = 50_000
AD_VOCAB = 20_000
SITE_VOCAB = 5_000
ID_COLUMNS = {"user_id": USER_VOCAB, "ad_id": AD_VOCAB, "site_id": SITE_VOCAB}
NUMERIC_COLUMNS = ["hour", "bid"]
LABEL = "clicked"
COLUMNS = [*ID_COLUMNS, *NUMERIC_COLUMNS, LABEL]

# Spread of the hidden per-id effects (logit scale): sites and ads matter most.
_EFFECT_SCALE = {"user_id": 0.6, "ad_id": 1.2, "site_id": 1.0}


def _power_law_ids(rng: np.random.Generator, vocab: int, rows: int) -> np.ndarray:
    # u**4 piles mass on small ranks; a fixed shuffle of ranks spreads popular ids over the range.
    ranks = (vocab * rng.random(rows) ** 4).astype(np.int64)
    return rng.permutation(vocab)[ranks]


def generate(path: str, rows: int = 20_000, seed: int = 0) -> int:
    """Write `rows` records to the CSV file `path`; the same seed writes the same file."""
    if rows <= 0:
        raise ValueError(f"rows must be positive, got {rows}")
    rng = np.random.default_rng(seed)
    effects = {c: rng.normal(0.0, _EFFECT_SCALE[c], vocab) for c, vocab in ID_COLUMNS.items()}
    ids = {c: _power_law_ids(rng, vocab, rows) for c, vocab in ID_COLUMNS.items()}
    hour = rng.integers(0, 24, rows)
    bid = np.round(rng.gamma(2.0, 0.5, rows), 3)
    logit = -1.2 + sum(effects[c][ids[c]] for c in ID_COLUMNS) + 0.8 * (bid - 1.0) + 0.7 * np.sin(2 * np.pi * hour / 24)
    clicked = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(COLUMNS)
        writer.writerows(zip(*(ids[c].tolist() for c in ID_COLUMNS), hour.tolist(), bid.tolist(), clicked.tolist()))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="CSV file to write")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"wrote {generate(args.output, args.rows, args.seed)} rows to {args.output}")


if __name__ == "__main__":
    main()
