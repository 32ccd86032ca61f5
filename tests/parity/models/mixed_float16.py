"""Habit: mixed precision as Keras's guide sets it up for a GPU: the `mixed_float16` policy (float16 compute,
float32 variables), the logits in float32, and the dynamic loss scaling `fit` trains it with (a
`LossScaleOptimizer`). Its initial scale is set high, so that the first steps overflow float16 and are skipped
while the scale comes down, in `fit` as here. Under SGD, which, unlike Adam, feels a gradient left scaled. Digits.
"""

import keras

# The contract's feed and eval_metrics: the data set's (digits.py), not these habits'.
from tests.parity.models.digits import eval_metrics as eval_metrics
from tests.parity.models.digits import feed as feed

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def model():
    # The policy in force while the layers are made, as the guide sets it, then put back: the parity test fits
    # other modules in the same process.
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        pixels = keras.Input(shape=(64,), name="pixels")
        hidden = keras.layers.Dense(64, activation="relu")(pixels)
        return keras.Model(pixels, keras.layers.Dense(10, dtype="float32", name="logits")(hidden))
    finally:
        keras.config.set_dtype_policy(previous)


def optimizer():
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=2.0**28)
