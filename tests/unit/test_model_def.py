"""ModelDef.training_loss: the stateless form (weights given as tensors, as PS workers run their step)
is the same loss, regularization and batch-norm statistics included, as the model called on its variables."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from elastic_step.model_def import load_model_def  # noqa: E402

MODEL = textwrap.dedent("""
    import keras

    def model():
        x = keras.Input(shape=(4,))
        h = keras.layers.Dense(8, kernel_regularizer=keras.regularizers.L2(0.1))(x)
        h = keras.layers.BatchNormalization()(h)
        return keras.Model(x, keras.layers.Dense(2)(h))

    def loss(labels, predictions):
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True))

    def optimizer():
        return keras.optimizers.SGD(0.1)

    def feed(batch):
        return batch["x"], batch["y"]
""")


def test_stateless_loss_equals_the_stateful_one(tmp_path):
    path = tmp_path / "bn_l2.py"
    path.write_text(MODEL)
    md = load_model_def(str(path))
    keras.utils.set_random_seed(1)
    a = md.model()
    keras.utils.set_random_seed(1)
    b = md.model()
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    y = np.arange(16) % 2
    stateful = md.training_loss(a, x, y)
    values = [v.value + 0.0 for v in b.trainable_variables]  # the same values, as plain tensors
    stateless = md.training_loss(b, x, y, trainable_values=values)
    assert float(a.losses[0]) > 0  # the L2 term is part of both
    np.testing.assert_allclose(float(stateless), float(stateful), rtol=1e-6)
    # batch norm's moving statistics moved in both
    for va, vb in zip(a.non_trainable_variables, b.non_trainable_variables):
        np.testing.assert_allclose(np.asarray(vb.value), np.asarray(va.value), rtol=1e-6)
    assert not np.allclose(np.asarray(b.non_trainable_variables[0].value), 0.0)
    # and the given tensors are what the model ran on: other values, another loss
    other = md.training_loss(b, x, y, trainable_values=[t * 2.0 for t in values])
    assert abs(float(other) - float(stateful)) > 1e-3
