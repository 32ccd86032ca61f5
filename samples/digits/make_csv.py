"""Regenerate digits.csv from scikit-learn's bundled copy of the UCI handwritten digits.

    python samples/digits/make_csv.py [OUT.csv]

1797 images of 8x8 pixels with values 0..16: columns pixel_0..pixel_63 and label (0..9).
"""
from __future__ import annotations

import csv
import os
import sys


def make_csv(path: str) -> int:
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    digits = load_digits()
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow([f"pixel_{i}" for i in range(64)] + ["label"])
        for pixels, label in zip(digits.data.astype(int), digits.target.astype(int)):
            writer.writerow([*pixels.tolist(), int(label)])
    return len(digits.target)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "digits.csv")
    print(f"wrote {make_csv(out)} rows to {out}")
