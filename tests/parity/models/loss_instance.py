"""Habit: a `keras.losses.Loss` instance rather than a function, with `from_logits=True`.

What `model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))` users do:
the module attribute `loss` is the instance itself and keeps its own reduction. Digits, a
functional model ending in logits.
"""

import keras
import numpy as np

PIXELS = [f"pixel_{i}" for i in range(64)]

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def model():
    pixels = keras.Input(shape=(64,), name="pixels")
    hidden = keras.layers.Dense(64, activation="relu")(pixels)
    logits = keras.layers.Dense(10, name="logits")(hidden)
    return keras.Model(pixels, logits)


def optimizer():
    return keras.optimizers.Adam(learning_rate=2e-3)


def feed(batch):
    x = np.stack([batch[c] for c in PIXELS], axis=1).astype("float32") / 16.0
    return x, batch["label"].astype("int64")


def eval_metrics():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy")}
