"""Habit: decoupled weight decay (the optimizer's `weight_decay`), biases excluded by name, and
gradient clipping by the global norm.

Keras shrinks each variable by `weight_decay × learning_rate` per step before the update, except
variables whose name matches `exclude_from_weight_decay(var_names=...)`; `global_clipnorm` scales a
step's gradients together so their joint norm is at most 0.1. Both are strong here: the decay
halves a weight no gradient holds up within ~140 steps, and most steps are clipped. In `ps` mode the norm
spans every shard's part, so the worker clips before it pushes. Digits.
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
    opt = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9, weight_decay=0.05, global_clipnorm=0.1)
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt
