"""Habit: several named `keras.Input`s, fed as a dict keyed by input name.

A functional model with one tower per input: the upper and the lower half of each digit image
(32 pixels each, the same shape, so feeding one where the other belongs raises nothing: it only
trains the wrong tower). `feed` returns `({"upper": ..., "lower": ...}, labels)`; the model's
inputs are declared upper first, which is not their sorted order. Digits.
"""

import keras
import numpy as np

UPPER = [f"pixel_{i}" for i in range(32)]
LOWER = [f"pixel_{i}" for i in range(32, 64)]


def model():
    upper = keras.Input(shape=(32,), name="upper")
    lower = keras.Input(shape=(32,), name="lower")
    a = keras.layers.Dense(32, activation="relu", name="upper_tower")(upper)
    b = keras.layers.Dense(32, activation="relu", name="lower_tower")(lower)
    merged = keras.layers.Concatenate()([a, b])
    probabilities = keras.layers.Dense(10, activation="softmax")(merged)
    return keras.Model({"upper": upper, "lower": lower}, probabilities)


def loss(labels, predictions):
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, predictions))


def optimizer():
    return keras.optimizers.Adam(learning_rate=2e-3)


def feed(batch):
    def half(columns):
        return np.stack([batch[c] for c in columns], axis=1).astype("float32") / 16.0

    return {"upper": half(UPPER), "lower": half(LOWER)}, batch["label"].astype("int64")


def eval_metrics():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy")}
