"""Habit: a `keras.losses.Loss` instance rather than a function, with `from_logits=True`.

What `model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))` users do:
the module attribute `loss` is the instance itself and keeps its own reduction. Digits, a
functional model ending in logits.
"""

import keras

# The contract's feed and eval_metrics: the data set's (digits.py), not this habit's.
from tests.parity.models.digits import eval_metrics as eval_metrics
from tests.parity.models.digits import feed as feed

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def model():
    pixels = keras.Input(shape=(64,), name="pixels")
    hidden = keras.layers.Dense(64, activation="relu")(pixels)
    logits = keras.layers.Dense(10, name="logits")(hidden)
    return keras.Model(pixels, logits)


def optimizer():
    return keras.optimizers.Adam(learning_rate=2e-3)
