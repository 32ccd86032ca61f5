"""Habit: weight decay as an L2 `kernel_regularizer`, trained with plain SGD.

Keras adds each layer's regularization loss to the loss `fit` minimises (and reports it in the
loss `evaluate` returns); the user's `loss()` never mentions it. The penalty is strong enough to
shape the weights, and plain SGD (unlike Adam) feels the loss's scale. Digits.
"""

import keras
import numpy as np

PIXELS = [f"pixel_{i}" for i in range(64)]


def model():
    l2 = keras.regularizers.L2(3e-3)
    return keras.Sequential(
        [
            keras.Input(shape=(64,)),
            keras.layers.Dense(64, activation="relu", kernel_regularizer=l2),
            keras.layers.Dense(10, activation="softmax", kernel_regularizer=l2),
        ]
    )


def loss(labels, predictions):
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, predictions))


def optimizer():
    return keras.optimizers.SGD(learning_rate=0.2)


def feed(batch):
    x = np.stack([batch[c] for c in PIXELS], axis=1).astype("float32") / 16.0
    return x, batch["label"].astype("int64")


def eval_metrics():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy")}
