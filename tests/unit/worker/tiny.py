"""A tiny model for the step builders' tests, with no PS client and no ring: two dense layers, squared error and
plain SGD, whose updates a test replays by hand."""

from __future__ import annotations

import textwrap

import numpy as np

MODEL = textwrap.dedent("""
    import keras

    def model():
        x = keras.Input(shape=(3,))
        h = keras.layers.Dense(4, name="hidden")(x)
        return keras.Model(x, keras.layers.Dense(1, name="out")(h))

    def loss(labels, predictions):
        return keras.ops.mean(keras.ops.square(labels - predictions))

    def optimizer():
        return keras.optimizers.SGD(0.1)

    def feed(batch):
        return batch["x"], batch["y"]
""")
LR = 0.1  # the optimizer's


def tiny(tmp_path):
    """(the model definition, its model, 8 records as (features, labels) tensors)."""
    import tensorflow as tf

    from elastic_step.model_def import load_model_def

    (tmp_path / "tiny.py").write_text(MODEL)
    model_def = load_model_def(str(tmp_path / "tiny.py"))
    rng = np.random.default_rng(0)
    data = (tf.constant(rng.normal(size=(8, 3)), tf.float32), tf.constant(rng.normal(size=(8, 1)), tf.float32))
    return model_def, model_def.model(), data


def bound(b: int):
    """A record bound as the steps take it: [b]."""
    import tensorflow as tf

    return tf.constant([b], tf.int64)
