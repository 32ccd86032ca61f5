"""Habit: a dict of inputs of several dtypes, strings included, one of them already a tensor.

`feed` returns `({"pixels": <float32 numpy array>, "shade": <tf.string tensor>}, labels)`: the
pixels as numbers, and a word per record ("dark", "mid" or "light", from the image's ink) that the
model hashes into a one-hot vector, as a Keras user feeds a categorical text column. Digits.
"""

import keras
import numpy as np
import tensorflow as tf

PIXELS = [f"pixel_{i}" for i in range(64)]


def model():
    pixels = keras.Input(shape=(64,), name="pixels")
    shade = keras.Input(shape=(1,), dtype="string", name="shade")
    words = keras.layers.Hashing(num_bins=8, output_mode="one_hot")(shade)
    hidden = keras.layers.Dense(32, activation="relu")(pixels)
    merged = keras.layers.Concatenate()([hidden, words])
    return keras.Model({"pixels": pixels, "shade": shade}, keras.layers.Dense(10, activation="softmax")(merged))


loss = keras.losses.SparseCategoricalCrossentropy()


def optimizer():
    return keras.optimizers.Adam(learning_rate=2e-3)


def feed(batch):
    pixels = np.stack([batch[c] for c in PIXELS], axis=1).astype("float32")
    ink = pixels.sum(axis=1)
    words = np.select([ink < 250, ink < 320], ["light", "mid"], "dark").reshape(-1, 1)
    return {"pixels": pixels / 16.0, "shade": tf.constant(words)}, batch["label"].astype("int64")


def eval_metrics():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy")}
