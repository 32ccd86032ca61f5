"""The PS worker's step graph, built and run without a PS client: a step's loss and per-shard gradient buffers
are the model's own, laid out as the placement lays its variables over the shards; a group step pushes the mean
of its minibatches' gradients; a call on copies of the shards applies each minibatch's update to them in turn."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from elastic_step.ps.api import Placement, variable_names  # noqa: E402
from elastic_step.worker.ps.step import build_steps  # noqa: E402
from tests.unit.worker.tiny import LR, bound, tiny  # noqa: E402

SHARDS = 2


@pytest.fixture()
def tiny_model(tmp_path):
    """(model definition, model, placement over SHARDS shards, 8 records)."""
    model_def, model, data = tiny(tmp_path)
    return model_def, model, Placement.of(model, SHARDS), data


def flats_of(model, placement, values=None) -> list[np.ndarray]:
    """Each shard's flat buffer, as the placement lays the model's variables (or `values`, by name) over them."""
    values = values or {n: v.numpy() for n, v in zip(variable_names(model), model.trainable_variables)}
    return [
        np.concatenate([np.ravel(values[n]) for n in placement.dense_on(s)] + [np.zeros(0, np.float32)]).astype(
            np.float32
        )
        for s in range(placement.num_ps)
    ]


def loss_and_grads(model, x, y, values=None):
    """The loss of records (x, y) and each variable's gradient, by name, at the model's values (or `values`)."""
    names = variable_names(model)
    if values is not None:
        for n, v in zip(names, model.trainable_variables):
            v.assign(values[n])
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(y - model(x)))
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss), {n: g.numpy() for n, g in zip(names, grads)}


def test_a_step_gives_the_models_loss_and_its_gradient_laid_out_over_the_shards(tiny_model):
    model_def, model, placement, data = tiny_model
    steps = build_steps(model_def, model, placement)
    assert steps.copies_step is None and steps.copies == []
    assert [int(spec.shape[0]) for spec in steps.flat_specs] == [f.size for f in flats_of(model, placement)]
    loss, dense, sparse = steps.step(data, bound(2), bound(6), [tf.constant(f) for f in flats_of(model, placement)])
    want_loss, want_grads = loss_and_grads(model, data[0][2:6], data[1][2:6])
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    assert sparse == []  # no embedding tables
    for got, want in zip(dense, flats_of(model, placement, want_grads)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_a_step_runs_on_the_values_it_is_given_not_the_models_variables(tiny_model):
    model_def, model, placement, data = tiny_model
    steps = build_steps(model_def, model, placement)
    given = {n: v.numpy() + 0.5 for n, v in zip(variable_names(model), model.trainable_variables)}
    loss, dense, _ = steps.step(data, bound(0), bound(8), [tf.constant(f) for f in flats_of(model, placement, given)])
    want_loss, want_grads = loss_and_grads(model, *data, values=given)
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    for got, want in zip(dense, flats_of(model, placement, want_grads)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_a_group_step_pushes_the_mean_of_its_minibatches_gradients(tiny_model):
    model_def, model, placement, data = tiny_model
    steps = build_steps(model_def, model, placement, minibatch_size=4, minibatches_per_push=2)
    loss, dense, _ = steps.step(data, bound(0), bound(8), [tf.constant(f) for f in flats_of(model, placement)])
    (loss_a, grads_a), (loss_b, grads_b) = (
        loss_and_grads(model, data[0][s], data[1][s]) for s in (slice(0, 4), slice(4, 8))
    )
    assert float(loss) == pytest.approx((loss_a + loss_b) / 2, rel=1e-5)
    mean = {n: (grads_a[n] + grads_b[n]) / 2 for n in grads_a}
    for got, want in zip(dense, flats_of(model, placement, mean)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_a_call_on_copies_applies_each_minibatchs_update_to_them_in_turn(tiny_model):
    model_def, model, placement, data = tiny_model
    steps = build_steps(model_def, model, placement, on_copies=True)
    assert len(steps.copies) == SHARDS and not steps.copies_carry_state
    values = {n: v.numpy() for n, v in zip(variable_names(model), model.trainable_variables)}
    losses, grads, states, finite = steps.copies_step(
        data, tf.constant([0, 4], tf.int64), tf.constant([4, 8], tf.int64)
    )
    assert states == [] and finite.numpy().tolist() == [True, True]
    for k, s in enumerate((slice(0, 4), slice(4, 8))):  # plain SGD, one minibatch after the other
        loss, g = loss_and_grads(model, data[0][s], data[1][s], values=values)
        assert float(losses[k]) == pytest.approx(loss, rel=1e-5)
        for shard, want in enumerate(flats_of(model, placement, g)):
            np.testing.assert_allclose(grads[shard][k].numpy(), want, rtol=1e-5, atol=1e-6)
        values = {n: values[n] - LR * g[n] for n in values}
    for copy, want in zip(steps.copies, flats_of(model, placement, values)):
        np.testing.assert_allclose(copy.values().numpy(), want, rtol=1e-5, atol=1e-6)
