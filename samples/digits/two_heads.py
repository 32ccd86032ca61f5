"""Handwritten digits with two heads: the digit (10 classes) and whether it is 5 or more (one sigmoid unit), on a
shared hidden layer. A model of several outputs as Keras users compile one: a loss per output (a dict),
`loss_weights`, labels per output from feed(), and a metric of one output (reported as `digit_accuracy`, which
`evaluate_op`'s gate can pick).

Train it with plain Keras or elastically, unchanged:

    elastic-step train --model-def samples/digits/two_heads.py --prepared data/digits --output out/two-heads ...

    net = model(); net.compile(optimizer=optimizer(), loss=loss, loss_weights=loss_weights,
                               metrics={"digit": list(eval_metrics()["digit"].values())})
"""

from __future__ import annotations

import keras
import numpy as np

FEATURES = [f"pixel_{i}" for i in range(64)]

loss = {
    "digit": keras.losses.SparseCategoricalCrossentropy(),
    "big": keras.losses.BinaryCrossentropy(),
}
loss_weights = {"digit": 1.0, "big": 0.5}


def model() -> keras.Model:
    pixels = keras.Input(shape=(len(FEATURES),), name="pixels")
    hidden = keras.layers.Dense(64, activation="relu", name="hidden")(pixels)
    return keras.Model(
        pixels,
        {
            "digit": keras.layers.Dense(10, activation="softmax", name="digit")(hidden),
            "big": keras.layers.Dense(1, activation="sigmoid", name="big")(hidden),
        },
        name="digits_two_heads",
    )


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(learning_rate=3e-3)


def feed(batch: dict[str, np.ndarray]):
    """Pixels scaled to 0..1; a label per output, by the output's name."""
    x = np.stack([batch[c] for c in FEATURES], axis=1).astype("float32") / 16.0
    digit = batch["label"].astype("int64")
    return x, {"digit": digit, "big": (digit >= 5).astype("float32")[:, None]}


def eval_metrics() -> dict:
    return {"digit": {"accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy")}}
