"""The digits data set as the digits modules here feed and score it: not a model module itself (no model,
no loss), the part of one that is the data's rather than the habit's. A module takes these as its own
contract functions (`from tests.parity.models.digits import eval_metrics, feed`), so it loads where the
repository's root is importable: the test process, and the CLI and its workers, which run from the root.

`feed`: the 64 pixel columns scaled from 0..16 to 0..1, and integer labels; `eval_metrics`: accuracy.
"""

import keras
import numpy as np

PIXELS = [f"pixel_{i}" for i in range(64)]


def feed(batch):
    x = np.stack([batch[c] for c in PIXELS], axis=1).astype("float32") / 16.0
    return x, batch["label"].astype("int64")


def eval_metrics():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy")}
