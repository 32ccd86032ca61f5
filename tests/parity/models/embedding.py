"""Habit: a `keras.Sequential` over integer ids with one shared `keras.layers.Embedding` table.

All categorical columns go through one table (each column's ids offset past the previous
column's vocabulary), flattened into an MLP; the loss is Keras's own function given as is
(`loss = keras.losses.binary_crossentropy`, per-example). In ps mode the table's rows are spread
over the parameter servers by id. CTR data (samples/ctr/generate.py).
"""

import keras
import numpy as np

VOCABS = {"user_id": 50_000, "ad_id": 20_000, "site_id": 5_000}
OFFSETS = dict(zip(VOCABS, np.cumsum([0, *VOCABS.values()])[:-1].tolist()))

loss = keras.losses.binary_crossentropy


def model():
    return keras.Sequential(
        [
            keras.Input(shape=(len(VOCABS),), dtype="int64"),
            keras.layers.Embedding(sum(VOCABS.values()), 8),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )


def optimizer():
    return keras.optimizers.Adagrad(learning_rate=0.1)


def feed(batch):
    ids = np.stack([batch[c].astype("int64") + OFFSETS[c] for c in VOCABS], axis=1)
    return ids, batch["clicked"].astype("float32").reshape(-1, 1)


def eval_metrics():
    return {"auc": keras.metrics.AUC(name="auc"), "accuracy": keras.metrics.BinaryAccuracy(name="accuracy")}
