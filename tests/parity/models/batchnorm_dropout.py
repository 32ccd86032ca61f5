"""Habit: BatchNormalization and Dropout between dense layers.

Both behave differently in training and in inference: Dropout is off at evaluation, and
BatchNormalization evaluates with the moving mean and variance it accumulated while training (its
non-trainable state). Pixels are fed raw (0..16, no scaling): normalising them is batch norm's job,
so a model whose moving statistics were never updated evaluates badly. Digits.
"""

import keras
import numpy as np

PIXELS = [f"pixel_{i}" for i in range(64)]


def model():
    return keras.Sequential(
        [
            keras.Input(shape=(64,)),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(64, use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.Activation("relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def loss(labels, predictions):
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, predictions))


def optimizer():
    return keras.optimizers.Adam(learning_rate=2e-3)


def feed(batch):
    x = np.stack([batch[c] for c in PIXELS], axis=1).astype("float32")  # raw 0..16
    return x, batch["label"].astype("int64")


def eval_metrics():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy")}
