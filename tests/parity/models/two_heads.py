"""Habit: a functional model with a dict of two outputs, compiled as Keras users compile one: a loss per output
(a dict), `loss_weights`, labels per output from the dataset, a metric of one output. Digits: the digit itself
and whether it is 5 or more.
"""

import keras
import numpy as np

from tests.parity.models.digits import PIXELS

loss = {
    "digit": keras.losses.SparseCategoricalCrossentropy(),
    "big": keras.losses.BinaryCrossentropy(),
}
loss_weights = {"digit": 1.0, "big": 0.5}


def model():
    inputs = keras.Input(shape=(64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    return keras.Model(
        inputs,
        {
            "digit": keras.layers.Dense(10, activation="softmax", name="digit")(hidden),
            "big": keras.layers.Dense(1, activation="sigmoid", name="big")(hidden),
        },
    )


def optimizer():
    return keras.optimizers.Adam(learning_rate=3e-3)


def feed(batch):
    x = np.stack([batch[c] for c in PIXELS], axis=1).astype("float32") / 16.0
    digit = batch["label"].astype("int64")
    return x, {"digit": digit, "big": (digit >= 5).astype("float32")[:, None]}


def eval_metrics():
    return {"digit": {"accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy")}}
