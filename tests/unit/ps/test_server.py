"""ParameterShard: real TensorFlow, no RPC. The fused flat update must be the per-variable update."""

from __future__ import annotations

import io

import numpy as np
import pytest

from tests.unit.ps.keys import key

keras = pytest.importorskip("keras")

from elastic_step import optimizers  # noqa: E402
from elastic_step.data.accounting import skipped_key  # noqa: E402
from elastic_step.ps import server, shard_graph  # noqa: E402
from elastic_step.ps.api import Placement  # noqa: E402
from elastic_step.ps.server import ParameterShard  # noqa: E402
from elastic_step.ps.shard_graph import updates_elementwise  # noqa: E402


def small_model():
    keras.utils.set_random_seed(3)
    x = keras.Input(shape=(6,))
    h = keras.layers.Dense(5, activation="relu")(x)
    return keras.Model(x, keras.layers.Dense(3)(h))


def shard(optimizer, monkeypatch=None, fused=True):
    if not fused:
        monkeypatch.setattr(shard_graph, "updates_elementwise", lambda _opt: False)
    m = small_model()
    return ParameterShard(m, optimizer, Placement.of(m, 1), 0)


def test_flat_update_matches_the_per_variable_update(monkeypatch):
    fused = shard(keras.optimizers.Adam(0.01))
    with monkeypatch.context() as mp:
        mp.setattr(optimizers, "fused_adam", lambda *_: None)  # Keras's own Adam, variable by variable
        reference = shard(keras.optimizers.Adam(0.01), mp, fused=False)
    assert len(fused.optimizer.variables) < len(reference.optimizer.variables)  # one flat variable
    assert "ResourceApplyAdam" in {op.type for op in fused._apply.graph.get_operations()}  # one kernel an update
    assert "ResourceApplyAdam" not in {op.type for op in reference._apply.graph.get_operations()}
    rng = np.random.default_rng(0)
    for seq in range(5):
        g = rng.normal(size=fused.dense_size).astype(np.float32)
        _, _, a = fused.push(key(0, seq), g, [])
        _, _, b = reference.push(key(0, seq), g, [])
        # One flat Adam is TensorFlow's fused kernel (optimizers.fused_adam), its 1 - beta_2 rounded to float32.
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(a, shard(keras.optimizers.Adam(0.01)).dense_flat())  # the pushes moved it


def test_a_key_is_applied_at_most_once():
    s = shard(keras.optimizers.SGD(0.1))
    g = np.ones(s.dense_size, np.float32)
    applied, version, once = s.push(key(7, 64), g, [])
    again, still, twice = s.push(key(7, 64), g, [])
    assert applied and not again and version == still == 1
    np.testing.assert_array_equal(once, twice)
    assert s.skipped == 1 and s.version == 1


@pytest.mark.parametrize("fused", [True, False])
def test_a_push_of_several_minibatches_applies_each_not_applied_before_in_turn(monkeypatch, fused):
    """As the same pushes one by one, each under its own key; one applied before is skipped, as a single push is."""
    many, one_by_one = shard(keras.optimizers.Adam(0.01), monkeypatch, fused), shard(keras.optimizers.Adam(0.01))
    grads = np.random.default_rng(1).normal(size=(4, many.dense_size)).astype(np.float32)
    bounds = (0, 64, 128, 192, 250)
    for s in (many, one_by_one):
        assert s.push(key(5, 64), grads[1], [])[0]  # applied before (a lost worker's push)
    for i in (0, 2, 3):
        one_by_one.push(key(5, bounds[i], records=bounds[i + 1] - bounds[i]), grads[i], [])
    each, version, values = many.push_many(key(5, 0, records=250), bounds, grads)
    assert each == [True, False, True, True] and version == many.version == 4 and many.skipped == 1
    np.testing.assert_allclose(values, one_by_one.dense_flat(), rtol=1e-6, atol=1e-7)
    assert many.applied_records.npz().keys() == one_by_one.applied_records.npz().keys()
    again, version, _ = many.push_many(key(5, 0, records=250), bounds, grads)  # every key applied: nothing moves
    assert again == [False] * 4 and version == 4


def test_a_copy_of_a_shard_loaded_with_its_values_and_optimizer_updates_as_the_shard_does():
    """A worker's copy (not served): loaded with the shard's values and optimizer state, its `update` in a
    compiled call gives what the shard's push gives."""
    import tensorflow as tf

    s = shard(keras.optimizers.Adam(0.01))
    g = np.random.default_rng(2).normal(size=(3, s.dense_size)).astype(np.float32)
    s.push(key(1, 0), g[0], [])
    m = small_model()
    copy = ParameterShard(m, keras.optimizers.Adam(0.01), Placement.of(m, 1), 0, serve=False)
    _version, flat, optimizer = s.optimizer_values()
    copy.load(flat, optimizer)
    update = tf.function(copy.update)
    for i in (1, 2):
        mine = update(tf.constant(g[i])).numpy()
        _, _, theirs = s.push(key(1, 64 * i), g[i], [])
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-7)


def optimizer_arrays(s: ParameterShard) -> list[np.ndarray]:
    return s.optimizer_values()[2]


@pytest.mark.parametrize("fused", [True, False])
def test_a_lone_workers_state_is_taken_only_at_its_base_with_every_minibatch_new(monkeypatch, fused):
    """A copy's state after its updates (`words`) replaces running them again only while the shard is at the
    version the copy started from and applies every minibatch; otherwise the shard applies nothing, counts
    nothing, and the worker pushes the gradients. The witness is a second shard that only ever applies gradients:
    values and optimizer state (Adam's moments and iteration count) equal after each push. A state push carries
    gradients that must not be read (NaN) and a state that must not be taken is garbage, so reading either shows."""
    import tensorflow as tf

    taker, witness = shard(keras.optimizers.Adam(0.01), monkeypatch, fused), shard(keras.optimizers.Adam(0.01))
    assert taker.state_words > taker.dense_size  # the values, then the moments and the count
    m = small_model()
    copy = ParameterShard(m, keras.optimizers.Adam(0.01), Placement.of(m, 1), 0, serve=False)
    rng = np.random.default_rng(4)
    bounds = (0, 64, 128, 192)

    def both(task, grads, state, base, each):
        k = key(task, 0, records=192)
        skipped, version = taker.skipped, taker.version
        got, _, _ = taker.push_many(k, bounds, np.full_like(grads, np.nan), None, state, base)
        if not any(got):  # declined: nothing applied or counted, and the gradients follow
            assert (taker.skipped, taker.version) == (skipped, version)
            got, _, _ = taker.push_many(k, bounds, grads)
        assert got == each
        assert witness.push_many(k, bounds, grads)[0] == each
        np.testing.assert_allclose(taker.dense_flat(), witness.dense_flat(), rtol=1e-6, atol=1e-7)
        for a, b in zip(optimizer_arrays(taker), optimizer_arrays(witness)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        assert (taker.version, taker.skipped) == (witness.version, witness.skipped)

    _version, flat, optimizer = taker.optimizer_values()
    copy.load(flat, optimizer)
    grads = rng.normal(size=(3, taker.dense_size)).astype(np.float32)
    for g in grads:
        tf.function(copy.update)(tf.constant(g))
    both(1, grads, copy.words().numpy(), 0, [True] * 3)
    assert taker.states_taken == 1

    garbage = np.full(taker.state_words, 7.0, np.float32)
    other = rng.normal(size=taker.dense_size).astype(np.float32)
    for s in (taker, witness):
        s.push(key(9, 0), other, [])  # another worker's push: the shard is past the base
    both(2, rng.normal(size=(3, taker.dense_size)).astype(np.float32), garbage, 3, [True] * 3)
    for s in (taker, witness):
        s.push(key(3, 64), other, [])  # one minibatch of the next call applied before (a lost worker's)
    both(3, rng.normal(size=(3, taker.dense_size)).astype(np.float32), garbage, taker.version, [True, False, True])
    assert taker.states_taken == 1


def test_a_state_taken_holds_for_whatever_comes_next_unread():
    """A taken state is loaded into the variables only when they are next read or updated: a gradient push, a
    checkpoint's save or another taken state right after it, unread in between, leave the shard where a shard that
    only ever applies gradients is."""
    import tensorflow as tf

    rng = np.random.default_rng(5)
    bounds = (0, 64, 128)
    for then in ("push", "save", "take again"):
        taker, witness = shard(keras.optimizers.Adam(0.01)), shard(keras.optimizers.Adam(0.01))
        m = small_model()
        copy = ParameterShard(m, keras.optimizers.Adam(0.01), Placement.of(m, 1), 0, serve=False)
        copy.load(*taker.optimizer_values()[1:])
        calls = 2 if then == "take again" else 1
        for call in range(calls):
            grads = rng.normal(size=(2, taker.dense_size)).astype(np.float32)
            for g in grads:
                tf.function(copy.update)(tf.constant(g))
            taker.push_many(key(call + 1, 0, records=128), bounds, grads, None, copy.words().numpy(), 2 * call)
            witness.push_many(key(call + 1, 0, records=128), bounds, grads)
        assert taker.states_taken == calls
        if then == "push":
            other = rng.normal(size=taker.dense_size).astype(np.float32)
            for s in (taker, witness):
                s.push(key(9, 0), other, [])
        if then == "save":
            saved = np.load(io.BytesIO(taker.save()))
            np.testing.assert_allclose(saved["dense"], witness.dense_flat(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(taker.dense_flat(), witness.dense_flat(), rtol=1e-6, atol=1e-7)
        for a, b in zip(optimizer_arrays(taker), optimizer_arrays(witness)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_only_stock_elementwise_optimizers_are_fused():
    class MyAdam(keras.optimizers.Adam):
        pass

    assert updates_elementwise(keras.optimizers.Adam())
    assert updates_elementwise(keras.optimizers.SGD(momentum=0.9))
    assert updates_elementwise(keras.optimizers.Adam(clipnorm=1.0))  # the worker clips, before the push
    assert not updates_elementwise(keras.optimizers.AdamW(weight_decay=0.01))  # may exclude variables
    assert not updates_elementwise(MyAdam())  # unknown update rule


def test_concurrent_pushes_each_get_one_consistent_version():
    # Replies are encoded after the shard's lock is released: each must be a private snapshot of
    # one version (with SGD on all-ones gradients: start - lr * k, the same k in every element),
    # never a view of the variable that the next update rewrites, and k is the version it comes with.
    import threading

    s = shard(keras.optimizers.SGD(0.125))
    start = s.dense_flat()
    g = np.ones(s.dense_size, np.float32)
    replies, lock = [], threading.Lock()

    def pusher(task):
        for seq in range(150):
            _, version, values = s.push(key(task, seq), g, [])
            with lock:
                replies.append((version, values))

    threads = [threading.Thread(target=pusher, args=(t,)) for t in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(version for version, _ in replies) == list(range(1, 301))  # each handed out once
    for version, v in replies:
        np.testing.assert_allclose(v, start - 0.125 * version, rtol=0, atol=1e-4)


def test_a_restored_shard_is_the_saved_one_values_slots_keys_and_records():
    s = shard(__import__("keras").optimizers.Adam(0.01))
    g = np.full(s.dense_size, 0.5, np.float32)
    s.push(key(1, 0), g, [])
    saved = s.save()
    at_save = s.snapshot()
    s.push(key(1, 64), g, [])  # after the cut: undone by the restore
    s.restore(saved, generation=1)
    with pytest.raises(server.StaleGeneration):  # computed for the state before the restore
        s.push(key(2, 0), g, [])
    assert s.snapshot()[0] == at_save[0]
    np.testing.assert_array_equal(s.snapshot()[1], at_save[1])
    assert s.applied == {(1, 0)} and s.applied_records.arrays()[(0, 0)].tolist() == [[0, 64]]
    # The optimizer's slots came back too: the same next push as an uninterrupted twin's.
    twin = shard(__import__("keras").optimizers.Adam(0.01))
    twin.push(key(1, 0), g, [])
    assert not s.push(key(1, 0)._replace(generation=1), g, [])[0]  # applied before the cut: still skipped
    np.testing.assert_allclose(
        s.push(key(1, 64)._replace(generation=1), g, [])[2], twin.push(key(1, 64), g, [])[2], rtol=1e-6
    )


def test_the_state_is_added_not_optimized_and_saved_with_the_weights():
    """BatchNormalization's moving statistics follow the weights in the flat buffer; a push's part for
    them is how the step changed them, added as is (no optimizer), once per key, and in the save."""
    keras.utils.set_random_seed(3)
    m = keras.Sequential([keras.Input(shape=(6,)), keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    placement = Placement.of(m, 1)
    s = ParameterShard(m, keras.optimizers.Adam(0.01), placement, 0)
    names = placement.dense_on(0)
    assert [n in placement.state for n in names] == [False] * 4 + [True] * 2  # gamma, beta, kernel, bias
    weights = sum(int(np.prod(placement.shapes[n])) for n in placement.weights_on(0))
    start = s.dense_flat()
    np.testing.assert_array_equal(start[weights:], [0.0] * 6 + [1.0] * 6)  # mean 0, variance 1
    change = np.zeros(s.dense_size, np.float32)
    change[:weights] = 0.5
    change[weights:] = np.arange(12, dtype=np.float32) / 10
    _, _, once = s.push(key(1, 0), change, [])
    np.testing.assert_allclose(once[weights:], start[weights:] + change[weights:], rtol=1e-6)
    assert not np.allclose(once[:weights], start[:weights] + 0.5)  # the weights went by Adam
    saved = s.save()
    s.push(key(1, 8), change, [])
    s.restore(saved, generation=1)
    np.testing.assert_array_equal(s.dense_flat(), once)


def one_layer(inputs: int, units: int):
    x = keras.Input(shape=(inputs,))
    return keras.Model(x, keras.layers.Dense(units, use_bias=False, name="projection")(x))


def test_a_restore_checks_every_variables_shape_not_only_the_sizes():
    """A (6, 4) kernel and a (4, 6) one have the same size and number of variables: restoring one into the other
    would reshape it silently. The refusal names the variable, both shapes, and why."""
    saved = ParameterShard(m := one_layer(6, 4), keras.optimizers.Adam(0.01), Placement.of(m, 1), 0).save()
    other = ParameterShard(m := one_layer(4, 6), keras.optimizers.Adam(0.01), Placement.of(m, 1), 0)
    before = other.dense_flat()
    with pytest.raises(ValueError) as raised:
        other.restore(saved, generation=1)
    assert str(raised.value).startswith(
        "'projection/kernel' is (4, 6) float32 in this model, (6, 4) float32 in the checkpoint's shard 0: "
        "the model changed since the job started"
    ), raised.value
    np.testing.assert_array_equal(other.dense_flat(), before)  # nothing was restored
    assert other.generation == 0


def test_a_skipped_minibatch_is_never_applied_and_its_records_are_accounted_as_skipped():
    """How a worker skips a minibatch (--skip-non-finite): its optimizer's state does not move either."""
    s = shard(keras.optimizers.Adam(0.01))
    before, slots = s.dense_flat(), [np.asarray(v.numpy()).copy() for v in s.optimizer.variables]
    with pytest.raises(ValueError, match="not finite"):  # never applied, even unmarked
        s.push(key(7, 64), np.full(s.dense_size, np.nan, np.float32), [])
    applied, version, values = s.push(key(7, 64, data_shard=~0), np.zeros(s.dense_size, np.float32), [])
    assert applied and version == 0  # accounted for, once, without an update
    np.testing.assert_array_equal(values, before)
    for v, b in zip(s.optimizer.variables, slots):
        np.testing.assert_array_equal(np.asarray(v.numpy()), b)
    k = key(7, 64)
    assert {e: r.tolist() for e, r in s.applied_records.arrays().items()} == {skipped_key(0, 0): [[64, k.end]]}
    assert not s.push(k, np.ones(s.dense_size, np.float32), [])[0]  # its key stays taken: a retry is a duplicate


def test_a_fenced_launch_s_pushes_are_refused_and_counted_its_successor_s_applied():
    s = shard(keras.optimizers.SGD(0.1))
    g = np.ones(s.dense_size, np.float32)
    zombie, successor = key(7, 64)._replace(worker=1, launch=1), key(7, 64)._replace(worker=1, launch=2)
    s.fences.fence(1, 1)
    with pytest.raises(server.FencedPush, match="^fenced: worker-1 launch 1"):
        s.push(zombie, g, [])
    assert s.fences.refused == 1 and s.version == 0 and not s.applied  # nothing applied, nothing accounted
    assert s.push(successor, g, [])[0] and s.version == 1
    assert s.push(key(8, 0), g, [])[0]  # a push that names no launch is never refused
    s.fences.fence(1, 2)
    with pytest.raises(server.FencedPush):
        s.push(successor._replace(seq=72), g, [])
    assert s.fences.refused == 2


def test_a_cut_taken_then_sent_is_the_state_at_the_take_though_pushes_went_on_between():
    """A checkpoint's cut in two calls: the workers are held only while the shard copies its state (take), and
    what it sends once they went on is the state at the take, as a whole save then would have written it."""
    s = shard(keras.optimizers.Adam(0.01))
    g = np.full(s.dense_size, 0.5, np.float32)
    s.push(key(1, 0), g, [])
    version = s.take(cut=7)
    whole = np.load(io.BytesIO(s.save()))
    s.push(key(1, 64), g, [])  # the workers went on before the send
    sent = np.load(io.BytesIO(s.send(7)))
    assert version == 1 and sorted(sent.files) == sorted(whole.files)
    for name in whole.files:
        np.testing.assert_array_equal(sent[name], whole[name], err_msg=name)
    with pytest.raises(KeyError, match="no state taken for checkpoint 7"):
        s.send(7)  # sent once, then forgotten
    s.take(cut=8)
    with pytest.raises(KeyError, match=r"checkpoint 9 \(taken: 8\)"):
        s.send(9)
