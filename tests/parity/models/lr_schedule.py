"""Habit: a learning-rate schedule, `ExponentialDecay` with Adam.

The rate at each step is the schedule's at the optimizer's step count (`optimizer.iterations`), so
a worker or shard that forgot its steps (a relaunch, a resume) would train at the start's rate
again, and allreduce, which scales the rate with its membership, must scale the schedule. The decay
is strong (the rate falls tenfold over the run's ~360 steps), so a constant rate lands elsewhere.
Digits.
"""

import keras

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
    schedule = keras.optimizers.schedules.ExponentialDecay(3e-3, decay_steps=100, decay_rate=0.5)
    return keras.optimizers.Adam(learning_rate=schedule)
