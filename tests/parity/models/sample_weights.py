"""Habit: per-record sample weights from the dataset, `fit`'s `(x, y, sample_weight)`.

Records the user does not trust get weight 0: a third of the digits have their label replaced by the
next digit and weigh nothing, in training and in evaluation (Keras's `evaluate` weighs the loss by
them; compile's `metrics` are unweighted, so accuracy counts those records too). Weights dropped in
training would train on the wrong labels: the evaluation's loss is then 0.56 instead of 0.17. Digits.
"""

import keras
import numpy as np

PIXELS = [f"pixel_{i}" for i in range(64)]


def model():
    return keras.Sequential(
        [
            keras.Input(shape=(64,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


loss = keras.losses.SparseCategoricalCrossentropy()


def optimizer():
    return keras.optimizers.Adam(learning_rate=2e-3)


def feed(batch):
    pixels = np.stack([batch[c] for c in PIXELS], axis=1)
    untrusted = pixels.sum(axis=1) % 3 == 0  # a third of the records, by content: the same in every split
    labels = np.where(untrusted, (batch["label"] + 1) % 10, batch["label"]).astype("int64")
    return pixels.astype("float32") / 16.0, labels, np.where(untrusted, 0.0, 1.0).astype("float32")


def eval_metrics():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy")}
