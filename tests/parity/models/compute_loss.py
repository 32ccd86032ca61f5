"""Habit: a loss customized the way Keras 3 advises, by overriding `Model.compute_loss` (here a penalty on the
logits' size added to the compiled loss). `fit` and `evaluate` compute the loss through it, so must
elastic-step; its effect on the weights is the metric `mean_abs_logit`, which the penalty keeps several times
smaller than without it. Digits.
"""

import keras

from tests.parity.models.digits import feed  # noqa: F401 - the module's feed()

PENALTY = 0.1


@keras.saving.register_keras_serializable(package="parity")
class PenalizedLogits(keras.Model):
    """A functional model whose loss adds PENALTY x the mean |logit|."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return loss + PENALTY * keras.ops.mean(keras.ops.abs(y_pred))


def model():
    inputs = keras.Input(shape=(64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    return PenalizedLogits(inputs, keras.layers.Dense(10)(hidden))


loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def optimizer():
    return keras.optimizers.Adam(learning_rate=3e-3)


def mean_abs_logit(labels, logits):
    return keras.ops.mean(keras.ops.abs(logits), axis=-1)


def eval_metrics():
    return {
        "accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy"),
        "mean_abs_logit": keras.metrics.MeanMetricWrapper(mean_abs_logit, name="mean_abs_logit"),
    }
