"""A compute-bound model for the throughput benchmark: a small CNN on the 8x8 digits.

Same data and contract as samples/digits/model.py, but most of a step is convolution, as in
the image models elastic-step targets, rather than per-step overhead.
"""

from __future__ import annotations

import keras
import numpy as np

FEATURES = [f"pixel_{i}" for i in range(64)]


def model() -> keras.Model:
    pixels = keras.Input(shape=(64,), dtype="float32", name="pixels")
    x = keras.layers.Reshape((8, 8, 1))(pixels)
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
    x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(128, activation="relu")(x)
    return keras.Model(pixels, keras.layers.Dense(10, activation="softmax")(x))


def loss(labels, predictions):
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, predictions))


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(learning_rate=1e-3)


def feed(batch):
    features = np.stack([np.asarray(batch[c], dtype=np.float32) for c in FEATURES], axis=1) / 16.0
    return features, np.asarray(batch["label"], dtype=np.int64)


def eval_metrics():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy")}
