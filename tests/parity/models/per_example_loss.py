"""Habit: a loss function that returns per-example losses and leaves the reduction to Keras.

Keras users write `return keras.losses.sparse_categorical_crossentropy(y, p, from_logits=True)` and
let `compile` average it; the model ends in logits, not a softmax. (Returning a `[batch]` vector used
to crash every elastic worker.) Digits: 64 pixels -> 10 classes.
"""

import keras

# The contract's feed and eval_metrics: the data set's (digits.py), not this habit's.
from tests.parity.models.digits import eval_metrics as eval_metrics
from tests.parity.models.digits import feed as feed


def model():
    return keras.Sequential(
        [
            keras.Input(shape=(64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),  # logits
        ]
    )


def loss(labels, predictions):
    return keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)


def optimizer():
    return keras.optimizers.Adam(learning_rate=2e-3)
