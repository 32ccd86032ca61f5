"""Habits: several named `keras.Input`s fed as a dict keyed by input name, of several dtypes, strings included,
one of them already a tensor.

`feed` returns `({"upper": ..., "lower": ..., "shade": <tf.string tensor>}, labels)`:
  * the upper and the lower half of each digit image (32 pixels each, the same shape, so feeding one where the
    other belongs raises nothing: it only trains the wrong tower), float32 numpy arrays; the model declares
    upper first, which is not their sorted order;
  * a word per record ("dark", "mid" or "light", from the image's ink) that the model hashes into a one-hot
    vector, as a Keras user feeds a categorical text column. Digits.
"""

import keras
import numpy as np
import tensorflow as tf

UPPER = [f"pixel_{i}" for i in range(32)]
LOWER = [f"pixel_{i}" for i in range(32, 64)]


def model():
    upper = keras.Input(shape=(32,), name="upper")
    lower = keras.Input(shape=(32,), name="lower")
    shade = keras.Input(shape=(1,), dtype="string", name="shade")
    a = keras.layers.Dense(32, activation="relu", name="upper_tower")(upper)
    b = keras.layers.Dense(32, activation="relu", name="lower_tower")(lower)
    words = keras.layers.Hashing(num_bins=8, output_mode="one_hot")(shade)
    merged = keras.layers.Concatenate()([a, b, words])
    probabilities = keras.layers.Dense(10, activation="softmax")(merged)
    return keras.Model({"upper": upper, "lower": lower, "shade": shade}, probabilities)


loss = keras.losses.SparseCategoricalCrossentropy()


def optimizer():
    return keras.optimizers.Adam(learning_rate=2e-3)


def feed(batch):
    def half(columns):
        return np.stack([batch[c] for c in columns], axis=1).astype("float32") / 16.0

    ink = sum(batch[c] for c in UPPER + LOWER)
    words = np.select([ink < 250, ink < 320], ["light", "mid"], "dark").reshape(-1, 1)
    return {"upper": half(UPPER), "lower": half(LOWER), "shade": tf.constant(words)}, batch["label"].astype("int64")


def eval_metrics():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy")}
