"""An allreduce member's step graph, built and run without a ring or a master: the gradient is the model's own in
one flat buffer; an average applies through the user's optimizer; the kept state is what an undo goes back to; a
run's loop applies, computes and hands each gradient to its callback, step after step."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from elastic_step.worker.allreduce.step import build_steps  # noqa: E402
from tests.unit.worker.tiny import LR, bound, tiny  # noqa: E402


def no_loop(loss, flat):
    raise AssertionError("run_loop's callback called outside run_loop")


@pytest.fixture()
def tiny_model(tmp_path):
    """(model definition, model, its optimizer built, 8 records)."""
    model_def, model, data = tiny(tmp_path)
    optimizer = model_def.optimizer()
    optimizer.build(model.trainable_variables)
    return model_def, model, optimizer, data


def weights(model) -> np.ndarray:
    return np.concatenate([v.numpy().ravel() for v in model.trainable_variables])


def loss_and_flat(model, x, y) -> tuple[float, np.ndarray]:
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(y - model(x)))
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss), np.concatenate([g.numpy().ravel() for g in grads])


def test_a_minibatchs_gradient_is_the_models_in_one_flat_buffer(tiny_model):
    model_def, model, optimizer, data = tiny_model
    steps = build_steps(model_def, model, optimizer, no_loop)
    assert steps.size == weights(model).size
    loss, flat = steps.grad_step(data)
    want_loss, want_flat = loss_and_flat(model, *data)
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(flat.numpy(), want_flat, rtol=1e-5, atol=1e-6)
    loss, flat = steps.lease_steps[None](data, bound(2), bound(6))
    want_loss, want_flat = loss_and_flat(model, data[0][2:6], data[1][2:6])
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(flat.numpy(), want_flat, rtol=1e-5, atol=1e-6)


def test_an_average_applies_through_the_optimizer_and_an_undo_goes_back_to_the_kept_state(tiny_model):
    model_def, model, optimizer, data = tiny_model
    steps = build_steps(model_def, model, optimizer, no_loop)
    before = weights(model)
    mean = np.linspace(-1, 1, steps.size).astype(np.float32)
    steps.apply[True](tf.constant(mean))  # a run's first step: the state is kept first
    np.testing.assert_allclose(weights(model), before - LR * mean, rtol=1e-5, atol=1e-6)
    steps.apply[False](tf.constant(mean))
    np.testing.assert_allclose(weights(model), before - 2 * LR * mean, rtol=1e-5, atol=1e-6)
    steps.undo()
    np.testing.assert_allclose(weights(model), before)


def test_a_lease_step_after_a_step_computes_its_gradient_on_the_weights_that_step_left(tiny_model):
    model_def, model, optimizer, data = tiny_model
    steps = build_steps(model_def, model, optimizer, no_loop)
    before = weights(model)
    mean = np.full(steps.size, 0.5, np.float32)
    loss, flat = steps.lease_steps[True](tf.constant(mean), data, bound(0), bound(4))
    np.testing.assert_allclose(weights(model), before - LR * mean, rtol=1e-5, atol=1e-6)
    want_loss, want_flat = loss_and_flat(model, data[0][:4], data[1][:4])
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(flat.numpy(), want_flat, rtol=1e-5, atol=1e-6)
    steps.undo()
    np.testing.assert_allclose(weights(model), before)


def test_a_runs_loop_hands_each_gradient_to_its_callback_and_applies_what_it_hands_back(tiny_model):
    """Two steps in one call: each applies the average it was handed, then computes the next minibatch's gradient
    on the weights that left; the callback hands back the next average and records, or stops the loop."""
    model_def, model, optimizer, data = tiny_model
    seen = []

    def step_done(loss, flat):
        seen.append((float(loss), np.array(flat)))
        going = len(seen) < 2
        return flat.astype(np.float32), np.array([4], np.int64), np.array([8], np.int64), np.bool_(going)

    steps = build_steps(model_def, model, optimizer, step_done)
    before = weights(model)
    first = np.full(steps.size, 0.25, np.float32)
    steps.run_loop(tf.constant(first), data, bound(0), bound(4), tf.constant(True))
    assert len(seen) == 2
    # Step by step, on the model itself: apply, gradient of [0, 4); apply it, gradient of [4, 8).
    steps.undo()
    np.testing.assert_allclose(weights(model), before)  # the loop kept the state before its first apply
    steps.apply[False](tf.constant(first))
    loss, flat = loss_and_flat(model, data[0][:4], data[1][:4])
    assert seen[0][0] == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(seen[0][1], flat, rtol=1e-5, atol=1e-6)
    steps.apply[False](tf.constant(flat))
    loss, flat = loss_and_flat(model, data[0][4:], data[1][4:])
    assert seen[1][0] == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(seen[1][1], flat, rtol=1e-5, atol=1e-6)
