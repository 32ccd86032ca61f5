"""Habit: an exponential moving average of the weights (`use_ema`) with momentum SGD, and each
variable's gradient clipped by its own norm (`clipnorm`, mild: a tight one bounds each step, and
allreduce takes more, part-full, steps than fit at the ends of its leases).

After `fit`, the model holds the averages, not the last weights (Keras's `finalize_variable_values`);
so must the model elastic-step saves and evaluates. The average is long (momentum 0.99 over the
run's ~360 steps) so it lags the weights: a model left with the last weights is caught (measured
with a tighter clipnorm: eval loss 0.63 with the averages against 0.41 without). Digits.
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
    return keras.optimizers.SGD(learning_rate=0.05, momentum=0.9, clipnorm=1.0, use_ema=True, ema_momentum=0.99)
