"""Habits: the optimizer's own options, all at once, with a `keras.losses.Loss` instance (`from_logits=True`).

SGD with momentum whose learning rate is a schedule (`ExponentialDecay`: read at the optimizer's step
count, `optimizer.iterations`, it halves every 100 of the run's ~360 steps), decoupled weight decay
(`weight_decay`, the biases excluded by name), gradient clipping by the global norm (`global_clipnorm`:
in `ps` mode the norm spans every shard's part, so the worker clips before it pushes), and a moving
average of the weights (`use_ema`: after `fit` the model holds the averages, Keras's
`finalize_variable_values`, and so must the model elastic-step saves and evaluates). The loss is the
`Loss` instance a `compile(loss=...)` user writes; it keeps its own reduction. Digits, a functional
model ending in logits.

Each option is strong enough that fit without it lands elsewhere: eval loss 1.06 with all of them
(seed 0), and without the schedule (its first rate throughout) 0.85, without the decay 0.73, without
the clipping 0.25, without the averages 0.73.
"""

import keras

# The contract's feed and eval_metrics: the data set's (digits.py), not these habits'.
from tests.parity.models.digits import eval_metrics as eval_metrics
from tests.parity.models.digits import feed as feed

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def model():
    pixels = keras.Input(shape=(64,), name="pixels")
    hidden = keras.layers.Dense(64, activation="relu")(pixels)
    return keras.Model(pixels, keras.layers.Dense(10, name="logits")(hidden))


def optimizer():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=100, decay_rate=0.5)
    opt = keras.optimizers.SGD(
        learning_rate=schedule, momentum=0.9, weight_decay=0.05, global_clipnorm=0.1, use_ema=True, ema_momentum=0.995
    )
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt
