"""Regenerate digits.csv from scikit-learn's bundled copy of the UCI handwritten digits (needs
scikit-learn, which nothing else here does), or write a larger, augmented set generated from digits.csv
(for the demo: enough data that training, not start-up, fills the report's charts).

    python samples/digits/make_csv.py [OUT.csv]
    python samples/digits/make_csv.py --copies 64 [--seed 0] OUT.csv

1797 images of 8x8 pixels with values 0..16: columns pixel_0..pixel_63 and label (0..9).
With --copies N, each image appears N times: once as it is, then N-1 variants shifted by up to one
pixel each way with a little pixel noise (seeded, so the same arguments write the same file).
Variants of one image land in both the train and the eval split, so accuracy on such an eval split
is not a held-out-writer figure: the set is for showing training at scale, not for benchmarking.
"""

from __future__ import annotations

import argparse
import csv
import os

import numpy as np

COLUMNS = [f"pixel_{i}" for i in range(64)] + ["label"]


DIGITS_CSV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.csv")


def make_csv(path: str) -> int:
    try:
        from sklearn.datasets import load_digits  # bundled with scikit-learn: no download
    except ImportError:
        raise SystemExit(
            "make_csv.py without --copies regenerates digits.csv from scikit-learn's copy of the digits: "
            "pip install scikit-learn (the project does not depend on it; --copies N reads digits.csv)"
        ) from None

    digits = load_digits()
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(COLUMNS)
        for pixels, label in zip(digits.data.astype(int), digits.target.astype(int)):
            writer.writerow([*pixels.tolist(), int(label)])
    return len(digits.target)


def augmented(copies: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(images (n, 64) in 0..16, labels (n,)): every digit of digits.csv `copies` times, shuffled (seeded)."""
    if copies < 1:
        raise ValueError(f"--copies must be >= 1, got {copies}")
    # Not scikit-learn: Keras imports it whenever it is installed, 0.6 s of CPU in every TensorFlow process.
    table = np.loadtxt(DIGITS_CSV, delimiter=",", skiprows=1, dtype=np.int16)
    images, target = table[:, :64].reshape(-1, 8, 8), table[:, 64].astype(np.int64)  # (1797, 8, 8), (1797,)
    rng = np.random.default_rng(seed)
    out = [images]
    for _ in range(copies - 1):
        shifts = rng.integers(-1, 2, size=(len(images), 2))
        shifted = np.empty_like(images)
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                pick = (shifts[:, 0] == dy) & (shifts[:, 1] == dx)
                # np.roll wraps around; the digits' borders are (nearly) blank, so a 1-pixel roll is a shift.
                shifted[pick] = np.roll(images[pick], (dy, dx), axis=(1, 2))
        noise = rng.integers(-1, 2, size=shifted.shape) * (rng.random(shifted.shape) < 0.15)
        out.append(np.clip(shifted + noise, 0, 16))
    x = np.concatenate(out).reshape(-1, 64)
    y = np.tile(target, copies)
    order = rng.permutation(len(y))
    return x[order], y[order]


def make_augmented_csv(path: str, copies: int, seed: int = 0) -> int:
    x, y = augmented(copies, seed)
    table = np.concatenate([x, y[:, None]], axis=1)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(",".join(COLUMNS) + "\n")
        np.savetxt(f, table, fmt="%d", delimiter=",")
    os.replace(tmp, path)  # a run interrupted mid-write never leaves a short file behind
    return len(y)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=DIGITS_CSV)
    parser.add_argument(
        "--copies",
        type=int,
        default=1,
        help="1: scikit-learn's digits as they are; N > 1: N variants of each (augmented)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.copies < 1:
        parser.error(f"--copies must be >= 1, got {args.copies}")
    rows = make_csv(args.out) if args.copies == 1 else make_augmented_csv(args.out, args.copies, args.seed)
    print(f"wrote {rows} rows to {args.out}")
