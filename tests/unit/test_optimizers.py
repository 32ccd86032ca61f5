"""The user's optimizer where the strategies need help around it: allreduce's scaling of a learning-rate
schedule, clipping as Keras clips, a PS shard's final values with use_ema, and Adam's fused kernel against Keras's
own Adam (real Keras, real TF)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from elastic_step.optimizers import LearningRateScale, clip_gradients, finalize, fused_adam, without_clipping


def test_a_schedule_is_scaled_and_still_follows_the_optimizers_step_count():
    import keras

    schedule = keras.optimizers.schedules.ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5)
    opt = keras.optimizers.SGD(learning_rate=schedule)
    w = keras.Variable(np.zeros(2, np.float32))
    opt.build([w])
    scale = LearningRateScale(opt)
    scale.set(0.5)
    opt.apply([np.ones(2, np.float32)], [w])  # step 0: 1.0 × 0.5
    opt.apply([np.ones(2, np.float32)], [w])  # step 1: 0.5 × 0.5
    np.testing.assert_allclose(w.numpy(), [-0.75, -0.75])
    assert int(opt.iterations.numpy()) == 2


def test_a_float_rate_is_scaled_from_the_rate_optimizer_gave():
    import keras

    opt = keras.optimizers.SGD(learning_rate=0.2)
    opt.build([keras.Variable(np.zeros(1, np.float32))])
    scale = LearningRateScale(opt)
    scale.set(0.5)
    scale.set(0.25)  # of the given rate, not of the last one set
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.05)


@pytest.mark.parametrize(
    "options, expected",
    [({"clipnorm": 1.0}, [[0.6, 0.8], [0.0, 0.5]]), ({"global_clipnorm": 1.0}, None), ({"clipvalue": 0.5}, None)],
)
def test_clipping_is_kerass_own(options, expected):
    import keras

    grads = [np.array([3.0, 4.0], np.float32), np.array([0.0, 0.5], np.float32)]
    opt = keras.optimizers.SGD(**options)
    got = [np.asarray(g) for g in clip_gradients(opt, grads)]
    want = expected or [np.asarray(g) for g in opt._clip_gradients(grads)]
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, rtol=1e-6)
    assert np.linalg.norm(np.concatenate(got)) <= 5.0
    assert clip_gradients(without_clipping(keras.optimizers.SGD(**options)), grads) == grads


def _adam_and_variables(kind, **options):
    """A Keras Adam of `options` built on fresh variables: one flat tf.Variable (a PS shard's), or the Keras
    variables of a small model (allreduce's), always the same starting values."""
    import keras
    import tensorflow as tf

    if kind == "flat":
        variables = [tf.Variable(np.random.default_rng(0).standard_normal(1000).astype(np.float32))]
    else:
        keras.utils.set_random_seed(0)
        variables = keras.Sequential([keras.Input(shape=(30,)), keras.layers.Dense(20), keras.layers.Dense(3)]).weights
    optimizer = keras.optimizers.Adam(**options)
    optimizer.build(variables)
    return optimizer, variables


@pytest.mark.parametrize("kind", ["flat", "model"])
def test_fused_adam_trains_as_kerass_adam_with_a_schedule(kind):
    import keras
    import tensorflow as tf

    def options():
        schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=5, decay_rate=0.5)
        return {"learning_rate": schedule, "beta_1": 0.8, "epsilon": 1e-4}

    keras_adam, mine = _adam_and_variables(kind, **options())
    fused_one, theirs = _adam_and_variables(kind, **options())
    start = [np.asarray(v.numpy()) for v in mine]
    keras_step = tf.function(lambda grads: keras_adam.apply(grads, mine))
    fused_step = tf.function(fused_adam(fused_one, theirs))
    rng = np.random.default_rng(1)
    for _ in range(30):
        grads = [tf.constant(rng.standard_normal(v.shape).astype(np.float32)) for v in mine]
        keras_step(grads)
        fused_step(grads)
    assert "ResourceApplyAdam" in {op.type for op in fused_step.get_concrete_function(grads).graph.get_operations()}
    assert int(fused_one.iterations.numpy()) == int(keras_adam.iterations.numpy()) == 30
    for before, a, b in zip(start, mine, theirs):
        moved = np.abs(np.asarray(a.numpy()) - before).mean()
        assert np.abs(np.asarray(b.numpy()) - np.asarray(a.numpy())).max() < moved / 1000  # rounding, not an update
    for a, b in zip(fused_one.variables, keras_adam.variables):  # the kernel takes 1 - beta_2 in float32: -1.3e-5
        np.testing.assert_allclose(np.asarray(a.numpy()), np.asarray(b.numpy()), rtol=3e-5, atol=1e-7)


def _declined():
    """Optimizers and variables that Keras's own `apply` must update."""
    import keras
    import tensorflow as tf

    class MyAdam(keras.optimizers.Adam):  # a subclass may change the update
        pass

    flat = [tf.Variable(np.zeros(4, np.float32))]
    constrained = keras.layers.Dense(2, kernel_constraint=keras.constraints.NonNeg())
    constrained.build((None, 3))
    cases = {
        f"Adam({k}={v})": (keras.optimizers.Adam(**{k: v}), flat)
        for k, v in [("amsgrad", True), ("weight_decay", 0.01), ("use_ema", True), ("gradient_accumulation_steps", 2)]
    }
    cases.update(
        {
            "a subclass": (MyAdam(), flat),
            "SGD": (keras.optimizers.SGD(), flat),
            "float16": (keras.optimizers.Adam(), [tf.Variable(np.zeros(4, np.float16))]),
            "a constraint": (keras.optimizers.Adam(), constrained.weights),
        }
    )
    return cases


def test_fused_adam_leaves_every_other_optimizer_option_and_variable_to_keras():
    for name, (optimizer, variables) in _declined().items():
        optimizer.build(variables)
        assert fused_adam(optimizer, variables) is None, name


def _dense_model():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input(shape=(3,)), keras.layers.Dense(2)])


def test_a_ps_shard_keeps_the_moving_averages_the_final_model_holds():
    """One push to a shard whose optimizer keeps an EMA: the shard's final values are the averages,
    which are not its weights, and are what Keras's finalize_variable_values would leave."""
    import keras

    from elastic_step.ps.api import FINAL_DENSE, Placement, PushKey
    from elastic_step.ps.server import ParameterShard

    model = _dense_model()

    def opt():
        return keras.optimizers.SGD(learning_rate=0.1, use_ema=True, ema_momentum=0.5)

    placement = Placement.of(model, 1)
    shard = ParameterShard(model, opt(), placement, 0)
    grad = np.ones(shard.dense_size, np.float32)
    for seq in range(3):
        shard.push(PushKey(task_id=1, seq=seq, end=seq + 1, epoch=0, data_shard=0), grad, [])
    saved = np.load(io.BytesIO(shard.save()))
    final, current = saved[FINAL_DENSE], saved["dense"]
    assert not np.allclose(final, current)

    # The same steps in one process, finalized as fit finalizes.
    reference = _dense_model()
    ref_opt = opt()
    for _ in range(3):
        ref_opt.apply(
            [np.ones(v.shape, np.float32) for v in reference.trainable_variables], reference.trainable_variables
        )
    ref_opt.finalize_variable_values(reference.trainable_variables)
    named = placement.unflatten(0, final)
    np.testing.assert_allclose(
        np.concatenate([named[n].ravel() for n in placement.weights_on(0)]),
        np.concatenate([v.numpy().ravel() for v in reference.trainable_variables]),
        rtol=1e-6,
    )


def test_finalize_gives_the_averages_from_an_optimizers_state():
    import keras

    model = _dense_model()
    opt = keras.optimizers.SGD(learning_rate=0.1, use_ema=True, ema_momentum=0.5)
    for _ in range(3):
        opt.apply([np.ones(v.shape, np.float32) for v in model.trainable_variables], model.trainable_variables)
    state = [np.asarray(v.numpy()) for v in opt.variables]
    opt.finalize_variable_values(model.trainable_variables)
    expected = [v.numpy() for v in model.trainable_variables]

    fresh = _dense_model()
    finalize(fresh, keras.optimizers.SGD(learning_rate=0.1, use_ema=True, ema_momentum=0.5), state)
    for got, want in zip(fresh.trainable_variables, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
