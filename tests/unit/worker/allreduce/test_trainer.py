"""An allreduce member's trainer: its gradients weigh its records as fit does, and a run of steps applied
before the master commits it is kept, served and undone as one."""

from __future__ import annotations

import json
import textwrap
import threading

import numpy as np
import pytest

from elastic_step.errors import ConfigError, DataError
from elastic_step.model_def import load_model_def
from elastic_step.worker.allreduce.trainer import AllReduceTrainer
from elastic_step.worker.finite import NonFinite


def test_the_allreduce_step_weighs_records_as_fit_and_takes_mixed_inputs(tmp_path):
    """A feed of (x, y, sample_weight) whose features mix a numpy array and a string tensor: the
    member's loss is fit's weighted loss, its record count the batch's."""
    import textwrap

    tf = pytest.importorskip("tensorflow")
    from elastic_step.model_def import load_model_def
    from elastic_step.worker.allreduce.trainer import AllReduceTrainer

    (tmp_path / "m.py").write_text(
        textwrap.dedent("""
        import keras, numpy as np, tensorflow as tf

        def model():
            x = keras.Input(shape=(2,), name="x")
            word = keras.Input(shape=(1,), dtype="string", name="word")
            hashed = keras.layers.Hashing(num_bins=4, output_mode="one_hot")(word)
            return keras.Model({"x": x, "word": word}, keras.layers.Dense(1)(keras.layers.Concatenate()([x, hashed])))

        def loss(labels, predictions):
            return keras.ops.square(labels - predictions)

        def optimizer():
            return keras.optimizers.SGD(0.1)

        def feed(batch):
            x = np.stack([batch["a"], batch["b"]], 1).astype("float32")
            y = batch["y"].astype("float32")[:, None]
            return {"x": x, "word": tf.constant(batch["word"][:, None])}, y, batch["w"]
    """)
    )
    md = load_model_def(str(tmp_path / "m.py"))
    rng = np.random.default_rng(0)
    rows = {
        "a": rng.normal(size=12),
        "b": rng.normal(size=12),
        "y": rng.normal(size=12),
        "w": rng.uniform(0, 2, 12),
        "word": rng.choice(["x", "y", "z"], 12),
    }
    trainer = AllReduceTrainer(md, md.model())
    loss, flat, n, skipped = trainer.gradients(rows)
    p = trainer.model(
        {"x": tf.constant(np.stack([rows["a"], rows["b"]], 1), tf.float32), "word": tf.constant(rows["word"][:, None])}
    ).numpy()[:, 0]
    assert n == 12 and flat.size == trainer.size and skipped is None
    assert loss == pytest.approx(float(np.sum(rows["w"] * (rows["y"] - p) ** 2) / 12), rel=1e-5)


MODEL = textwrap.dedent("""
    import json, os

    import keras
    import numpy as np

    def model():
        units = json.load(open(os.path.join(os.path.dirname(__file__), "config.json")))["units"]
        x = keras.Input(shape=(4,))
        h = keras.layers.Dense(units, name="hidden")(x)
        return keras.Model(x, keras.layers.Dense(1, name="out")(h))

    def loss(labels, predictions):
        return keras.ops.mean(keras.ops.square(labels - predictions))

    def optimizer():
        return keras.optimizers.Adam(0.01)

    def feed(batch):
        return batch["x"], batch["y"]
""")


def trainer(tmp_path, units: int, non_finite: NonFinite | None = None) -> AllReduceTrainer:
    """A member's trainer on a model whose width a file beside it sets, as a user's config file does."""
    (tmp_path / "model_def.py").write_text(MODEL)
    (tmp_path / "config.json").write_text(json.dumps({"units": units}))
    model_def = load_model_def(str(tmp_path / "model_def.py"))
    return AllReduceTrainer(model_def, model_def.model(), non_finite)


def test_a_state_of_another_shape_is_refused_naming_the_variable(tmp_path):
    """A resume after the config file changed the model: same layers, same number of variables, other shapes."""
    saved = trainer(tmp_path, 8).state()
    t = trainer(tmp_path, 6)
    before = [v.numpy().copy() for v in t.model.weights]
    with pytest.raises(ConfigError) as raised:  # bad input, as a PS shard's refusal is: exit 2 in both strategies
        t.load_state(*saved, there="checkpoint 3")
    assert str(raised.value).startswith(
        "Cannot load checkpoint 3: 'hidden/kernel' is (4, 6) float32 in this model, (4, 8) float32 in checkpoint 3: "
        "the model changed since the job started"
    ), raised.value
    assert "--job-id" in str(raised.value)
    for v, b in zip(t.model.weights, before):
        np.testing.assert_array_equal(v.numpy(), b)
    t.load_state(*trainer(tmp_path, 6).state(), there="checkpoint 3")  # the same model's state loads


def test_a_gradient_that_is_not_finite_stops_before_the_ring_naming_the_records(tmp_path):
    t = trainer(tmp_path, 3)
    batch = {"x": np.ones((4, 4), np.float32), "y": np.ones((4, 1), np.float32)}
    assert np.isfinite(t.gradients(batch, "records [0, 4) of part-0 in epoch 1")[0])
    batch["x"][2, 1] = np.inf
    with pytest.raises(DataError) as raised:
        t.gradients(batch, "records [4, 8) of part-0 in epoch 1")
    assert " on records [4, 8) of part-0 in epoch 1, before it was applied" in str(raised.value), raised.value


def test_a_skipped_minibatch_says_why_and_is_not_an_error(tmp_path):
    t = trainer(tmp_path, 3, NonFinite(skip=True))
    batch = {"x": np.ones((4, 4), np.float32), "y": np.ones((4, 1), np.float32)}
    assert t.gradients(batch)[3] is None
    batch["y"][1] = np.nan
    assert t.gradients(batch, "records [4, 8) of part-0 in epoch 1")[3] == "the loss became nan"


def test_a_lease_fed_once_gives_each_minibatch_the_gradient_it_gets_fed_alone(tmp_path):
    t = trainer(tmp_path, 3)
    rng = np.random.default_rng(1)
    lease = {"x": rng.normal(size=(10, 4)).astype(np.float32), "y": rng.normal(size=(10, 1)).astype(np.float32)}
    fed = t.feed(lease)
    for lo, hi in [(0, 4), (4, 8), (8, 10)]:  # the last minibatch short, as at a lease's end
        alone = t.gradients({k: v[lo:hi] for k, v in lease.items()})
        sliced = t.lease_gradients(fed, lo, hi)
        assert sliced[2] == hi - lo and sliced[0] == pytest.approx(alone[0], rel=1e-6)
        np.testing.assert_allclose(sliced[1], alone[1], rtol=1e-6, atol=1e-7)


def test_the_checksum_after_an_apply_is_that_of_the_weights_as_they_are(tmp_path):
    """The master compares the members' checksums before each commit: one taken in the apply must be the one a
    member that pulled these weights computes from them."""
    t, fresh = trainer(tmp_path, 3), trainer(tmp_path, 3)
    before = t.checksum()
    t.apply(np.full(t.size, 0.5, np.float32), 1.0)
    t.commit()
    fresh.load_state(*t.state())
    assert t.checksum() == fresh.checksum() != before


def test_a_run_not_committed_serves_the_state_before_it_and_an_undo_goes_back_to_it(tmp_path):
    """Steps are applied before the master commits their run: until then, a peer or a checkpoint pulls the state
    before the run, and an abort puts every weight and optimizer variable back, the learning rate too. The witness
    is a trainer that never applied."""
    t, untouched = trainer(tmp_path, 3), trainer(tmp_path, 3)
    untouched.load_state(*t.state())
    mean = np.linspace(-1, 1, t.size).astype(np.float32)
    t.apply(mean, 0.5)
    t.apply(mean, 1.0)
    assert t.checksum() != untouched.checksum()  # the live weights moved
    for served, before in zip(t.state()[1], untouched.state()[1]):
        np.testing.assert_array_equal(served, before)
    t.undo()
    assert t.checksum() == untouched.checksum()
    for now, before in zip(t.state()[1], untouched.state()[1]):
        np.testing.assert_array_equal(now, before)


def test_a_committed_run_is_its_steps_committed_one_by_one(tmp_path):
    t, stepwise = trainer(tmp_path, 3), trainer(tmp_path, 3)
    stepwise.load_state(*t.state())
    means = [np.linspace(-1, 1, t.size).astype(np.float32) * k for k in (1, -2, 3)]
    for run in (means[:2], means[2:]):  # the second run from a committed first: the kept state is taken anew
        for mean in run:
            t.apply(mean, 0.5)
            stepwise.apply(mean, 0.5)
            stepwise.commit()
        t.commit()
    assert t.checksum() == stepwise.checksum()
    for a, b in zip(t.state()[1], stepwise.state()[1]):
        np.testing.assert_array_equal(a, b)


def test_a_step_applied_in_the_next_minibatchs_call_is_that_step_applied_on_its_own(tmp_path):
    """A step's average is applied in the call that computes the next minibatch's gradient: the gradient must be that
    of the updated weights, and the run as undoable as one applied call by call. The witness applies each step on
    its own, committed, before computing the gradient."""
    t, alone = trainer(tmp_path, 3), trainer(tmp_path, 3)
    alone.load_state(*t.state())
    start = t.state()[1]
    rng = np.random.default_rng(2)
    lease = {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 1)).astype(np.float32)}
    fed, fed_alone = t.feed(lease), alone.feed(lease)
    mean = np.linspace(-1, 1, t.size).astype(np.float32)
    for lr_scale in (0.5, 0.5, 1.0):  # the run's first step keeps the state; then a step at a new rate
        t.apply(mean, lr_scale)
        fused = t.lease_gradients(fed, 0, 4)
        alone.apply(mean, lr_scale)
        alone.commit()
        want = alone.lease_gradients(fed_alone, 0, 4)
        assert fused[0] == pytest.approx(want[0], rel=1e-6)
        np.testing.assert_allclose(fused[1], want[1], rtol=1e-6, atol=1e-7)
    assert t.checksum() == alone.checksum()
    t.undo()
    for now, before in zip(t.state()[1], start):
        np.testing.assert_array_equal(now, before)


def test_a_run_of_steps_in_one_call_is_those_steps_taken_call_by_call(tmp_path):
    """A run's steps after its first run in one compiled loop, a callback between steps doing the rest of each (here
    a ring of one: the average is the member's own gradient). The witness takes the same steps call by call, each
    step's average applied in the next minibatch's call: every step's loss and gradient, and the weights at the
    end, are the same; what the callback left pending is applied by whoever reads the weights next; an undo goes
    back to the state before the run."""
    t, witness = trainer(tmp_path, 3), trainer(tmp_path, 3)
    initial = t.state()
    witness.load_state(*initial)
    start = initial[1]
    rng = np.random.default_rng(3)
    lease = {"x": rng.normal(size=(14, 4)).astype(np.float32), "y": rng.normal(size=(14, 1)).astype(np.float32)}
    fed, fed_witness = t.feed(lease), witness.feed(lease)
    first = t.lease_gradients(fed, 0, 4)  # the run's first step, as the worker takes it
    t.apply(first[1], 0.5)
    steps = []

    served = []

    def on_step(loss, flat):
        steps.append((loss, flat.copy()))
        if len(steps) == 1:  # a peer's or the master's pull meanwhile: the state before the run, without waiting
            reader = threading.Thread(target=lambda: served.append(t.state()[1]))
            reader.start()
            reader.join(timeout=10)
        lo = 4 * (len(steps) + 1)  # the next minibatch's
        return flat, 0.5, (lo, min(14, lo + 4)) if lo < 14 else None  # the last step's average left pending

    assert not t.run_steps(fed, 4, 8, on_step, lambda: "records 4-8")  # no rate set yet: the ordinary way first
    t.checksum()  # reads the weights: the first step applied on its own, its rate set
    t.apply(first[1], 0.5)  # (again, as a second step would be)
    assert t.run_steps(fed, 4, 8, on_step, lambda: "records 4-8")
    assert len(steps) == 3  # [4, 8), [8, 12), [12, 14)
    assert len(served) == 1
    for a, b in zip(served[0], start):
        np.testing.assert_array_equal(a, b)
    w = witness.lease_gradients(fed_witness, 0, 4)
    for mean in (w[1], w[1]):
        witness.apply(mean, 0.5)
    for (loss, flat), (lo, hi) in zip(steps, [(4, 8), (8, 12), (12, 14)]):
        want = witness.lease_gradients(fed_witness, lo, hi)
        assert loss == pytest.approx(want[0], rel=1e-6)
        np.testing.assert_allclose(flat, want[1], rtol=1e-5, atol=1e-6)
        witness.apply(want[1], 0.5)
    t.commit(), witness.commit()  # the pending average applied by both
    for a, b in zip(t.state()[1], witness.state()[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    t.undo()  # committed: nothing to go back to
    for a, b in zip(t.state()[1], witness.state()[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    again = trainer(tmp_path, 3)
    again.load_state(*initial)
    fed_again = again.feed(lease)
    again.apply(again.lease_gradients(fed_again, 0, 4)[1], 0.5)
    again.checksum()
    again.apply(first[1], 0.5)
    steps.clear()
    assert again.run_steps(fed_again, 4, 8, on_step, lambda: "records 4-8")
    again.undo()  # not committed: back to the state before the run
    for now, before in zip(again.state()[1], start):
        np.testing.assert_array_equal(now, before)


def test_a_run_in_one_call_stops_at_a_new_rate_and_raises_what_its_callback_raised(tmp_path):
    t = trainer(tmp_path, 3)
    rng = np.random.default_rng(4)
    fed = t.feed({"x": rng.normal(size=(12, 4)).astype(np.float32), "y": rng.normal(size=(12, 1)).astype(np.float32)})
    t.apply(t.lease_gradients(fed, 0, 4)[1], 1.0)
    t.checksum()
    calls = []

    def new_rate(loss, flat):
        calls.append(loss)
        return flat, 0.5, (8, 12)  # the next step at another rate: the loop stops, the average left pending

    t.apply(np.zeros(t.size, np.float32), 1.0)
    assert t.run_steps(fed, 4, 8, new_rate, lambda: "")
    assert len(calls) == 1 and t._pending is not None and t._pending[1] == 0.5
    assert not t.run_steps(fed, 8, 12, new_rate, lambda: "")  # not at the rate set: the ordinary way

    class PeerGone(Exception):
        pass

    def fails(loss, flat):
        raise PeerGone("worker-1 is gone")

    t.apply(np.zeros(t.size, np.float32), 1.0)
    t.checksum()
    t.apply(np.zeros(t.size, np.float32), 1.0)
    with pytest.raises(PeerGone, match="worker-1 is gone"):
        t.run_steps(fed, 4, 8, fails, lambda: "")
    assert t._pending is None


def test_a_runs_second_step_in_one_call_keeps_the_state_the_run_started_from(tmp_path):
    """Right after a run's first step (nothing kept yet), its next steps still run in one call: the call keeps the
    state before its first apply. A reader during the call gets that state without waiting; an undo goes back to
    it; the steps are those the witness takes call by call."""
    t, witness = trainer(tmp_path, 3), trainer(tmp_path, 3)
    initial = t.state()
    witness.load_state(*initial)
    rng = np.random.default_rng(5)
    lease = {"x": rng.normal(size=(12, 4)).astype(np.float32), "y": rng.normal(size=(12, 1)).astype(np.float32)}
    fed, fed_witness = t.feed(lease), witness.feed(lease)
    t.checksum()  # a rate set, as after a commit
    t.apply(np.zeros(t.size, np.float32), 0.5)
    t.commit()
    witness.apply(np.zeros(t.size, np.float32), 0.5)
    witness.commit()
    start = t.state()[1]
    first = t.lease_gradients(fed, 0, 4)  # the run's first step: nothing applied, nothing kept
    t.apply(first[1], 0.5)
    assert not t._kept_holds
    steps, served = [], []

    def on_step(loss, flat):
        steps.append((loss, flat.copy()))
        if len(steps) == 1:
            reader = threading.Thread(target=lambda: served.append(t.state()[1]))
            reader.start()
            reader.join(timeout=10)
            assert not reader.is_alive(), "the reader waited on the run's call"
        return flat, 0.5, (8, 12) if len(steps) == 1 else None

    assert t.run_steps(fed, 4, 8, on_step, lambda: "records 4-8")
    assert len(steps) == 2 and len(served) == 1
    for a, b in zip(served[0], start):
        np.testing.assert_array_equal(a, b)
    w = witness.lease_gradients(fed_witness, 0, 4)
    witness.apply(w[1], 0.5)
    for (loss, flat), (lo, hi) in zip(steps, [(4, 8), (8, 12)]):
        want = witness.lease_gradients(fed_witness, lo, hi)
        assert loss == pytest.approx(want[0], rel=1e-6)
        np.testing.assert_allclose(flat, want[1], rtol=1e-5, atol=1e-6)
        witness.apply(want[1], 0.5)
    t.undo()
    for now, before in zip(t.state()[1], start):
        np.testing.assert_array_equal(now, before)


def test_a_step_loss_scaling_skips_goes_to_the_ring_and_every_member_skips_it(tmp_path):
    """mixed_float16 at a loss scale no float16 gradient survives: the member's gradient is not finite, yet that is
    no failure and no --skip-non-finite skip. It goes to the ring as it is, so the average holds it on every member
    alike, and each skips the step as Keras's LossScaleOptimizer does: weights and optimizer state as they were.
    A loss that is not finite still fails."""
    keras = pytest.importorskip("keras")
    (tmp_path / "model_def.py").write_text(
        MODEL.replace(
            "keras.optimizers.Adam(0.01)", "keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), 1e30)"
        )
    )
    (tmp_path / "config.json").write_text(json.dumps({"units": 3}))
    model_def = load_model_def(str(tmp_path / "model_def.py"))
    keras.config.set_dtype_policy("mixed_float16")
    try:
        t = AllReduceTrainer(model_def, model_def.model())
    finally:
        keras.config.set_dtype_policy("float32")
    assert t.loss_scaled and type(t.optimizer) is keras.optimizers.Adam
    batch = {"x": np.ones((4, 4), np.float32), "y": np.ones((4, 1), np.float32)}
    loss, flat, n, skipped = t.gradients(batch, "records [0, 4) of part-0 in epoch 1")
    assert np.isfinite(loss) and not np.isfinite(flat).all() and skipped is None
    before = [v.numpy().copy() for v in t._targets]
    t.apply((flat + np.ones_like(flat)) / 2, 1.0)  # the ring's average of it and a finite one
    t.commit()
    for v, b in zip(t._targets, before):
        np.testing.assert_array_equal(v.numpy(), b, err_msg=v.path)
    t.apply(np.full_like(flat, 0.5), 1.0)  # a finite average is applied
    t.commit()
    assert int(t.optimizer.iterations.numpy()) == 1
    assert not np.array_equal(t.model.weights[0].numpy(), before[0])
    batch["y"][1] = np.nan
    with pytest.raises(DataError, match="the loss became nan on records"):
        t.gradients(batch, "records [4, 8) of part-0 in epoch 1")
