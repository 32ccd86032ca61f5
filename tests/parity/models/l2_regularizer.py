"""Habits: weight decay as an L2 `kernel_regularizer`, trained with plain SGD; a loss function that
returns per-example losses and leaves the reduction to Keras.

Keras adds each layer's regularization loss to the loss `fit` minimises (and reports it in the
loss `evaluate` returns); the user's `loss()` never mentions it. The penalty is strong enough to
shape the weights, and plain SGD (unlike Adam) feels the loss's scale.

Keras users write `return keras.losses.sparse_categorical_crossentropy(y, p)` and let `compile` average
it (returning a `[batch]` vector used to crash every elastic worker). Digits.
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
    return keras.losses.sparse_categorical_crossentropy(labels, predictions)


def optimizer():
    return keras.optimizers.SGD(learning_rate=0.2)


def feed(batch):
    x = np.stack([batch[c] for c in PIXELS], axis=1).astype("float32") / 16.0
    return x, batch["label"].astype("int64")


def eval_metrics():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy")}
