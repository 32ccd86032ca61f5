"""Handwritten digits (8x8 pixels, 10 classes): a small MLP following the elastic-step model contract.

Train it with plain Keras or elastically, unchanged:

    elastic-step data prep samples/digits/digits.csv --label label --output data/digits
    elastic-step train --model-def samples.digits.model --prepared data/digits --output out/digits ...
"""

from __future__ import annotations

import keras
import numpy as np

FEATURES = [f"pixel_{i}" for i in range(64)]
LABEL = "label"
NUM_CLASSES = 10


def model() -> keras.Model:
    pixels = keras.Input(shape=(len(FEATURES),), dtype="float32", name="pixels")
    x = keras.layers.Dense(128, activation="relu", name="hidden_1")(pixels)
    x = keras.layers.Dense(64, activation="relu", name="hidden_2")(x)
    probabilities = keras.layers.Dense(NUM_CLASSES, activation="softmax", name="probabilities")(x)
    return keras.Model(pixels, probabilities, name="digits_mlp")


def loss(labels, predictions):
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, predictions))


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(learning_rate=3e-3)


def feed(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    # Pixels are 0..16: scale to 0..1 here, so the data set keeps the raw values.
    features = np.stack([np.asarray(batch[c], dtype=np.float32) for c in FEATURES], axis=1) / 16.0
    labels = np.asarray(batch[LABEL], dtype=np.int64)
    return features, labels


def eval_metrics() -> dict[str, keras.metrics.Metric]:
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy")}
