"""A shard's variables and update graph, built and run without a server: its flat values are the model's, an
update applies the optimizer to them, and its words carry the whole state, optimizer included, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from elastic_step.ps.api import Placement, variable_names  # noqa: E402
from elastic_step.ps.shard_graph import build_graph, compile_graph, shard_variables  # noqa: E402


def small_model():
    keras.utils.set_random_seed(3)
    x = keras.Input(shape=(6,))
    return keras.Model(x, keras.layers.Dense(3)(keras.layers.Dense(5)(x)))


def flat(model, placement, shard) -> np.ndarray:
    values = dict(zip(variable_names(model), model.trainable_variables))
    return np.concatenate([values[n].numpy().ravel() for n in placement.weights_on(shard)])


@pytest.mark.parametrize("shard", [0, 1])
def test_a_shards_update_applies_the_optimizer_to_its_share_of_the_model(shard):
    model = small_model()
    placement = Placement.of(model, 2)
    variables = shard_variables(model, keras.optimizers.SGD(0.5), placement, shard)
    graph = build_graph(variables, placement.num_ps)
    before = flat(model, placement, shard)
    assert variables.dense_size == before.size
    np.testing.assert_array_equal(graph.values().numpy(), before)
    grad = np.linspace(-1, 1, before.size).astype(np.float32)
    np.testing.assert_allclose(graph.update(tf.constant(grad)).numpy(), before - 0.5 * grad, rtol=1e-6)
    np.testing.assert_allclose(
        graph.apply_many(tf.constant(np.stack([grad, grad]))).numpy(), before - 1.5 * grad, rtol=1e-5
    )


def test_a_shards_words_load_back_its_whole_state_bit_for_bit():
    model = small_model()
    placement = Placement.of(model, 1)
    variables = shard_variables(model, keras.optimizers.Adam(0.01), placement, 0)
    graph = build_graph(variables, 1)
    compiled = compile_graph(variables, graph)
    assert graph.state_words > variables.dense_size and compiled.load_words is not None and compiled.final is None
    compiled.apply(tf.ones([variables.dense_size]), [], [])
    saved = graph.words().numpy()
    compiled.apply(tf.ones([variables.dense_size]), [], [])
    assert not np.array_equal(graph.words().numpy(), saved)
    compiled.load_words(tf.constant(saved))
    np.testing.assert_array_equal(graph.words().numpy(), saved)
    np.testing.assert_array_equal(compiled.read().numpy(), saved[: variables.dense_size])
