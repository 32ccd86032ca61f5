"""The worker's PS trainer against a real PS shard on loopback gRPC: a minibatch is the records it
names (sliced inside the compiled step), and it pulls exactly the embedding rows they look up."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from elastic_step.data.accounting import skipped_key
from elastic_step.errors import DataError
from elastic_step.proto import rpc, tensors
from elastic_step.worker.finite import NonFinite
from elastic_step.worker.records import Records

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from elastic_step.model_def import load_model_def  # noqa: E402
from elastic_step.proto import elastic_pb2_grpc as pb_grpc  # noqa: E402
from elastic_step.ps.api import Placement, PushKey, load_named, named_variables  # noqa: E402
from elastic_step.ps.client import PSClient  # noqa: E402
from elastic_step.ps.server import ParameterServerService, ParameterShard  # noqa: E402
from elastic_step.worker.ps.trainer import ALONE_AGAIN, Company, PSTrainer  # noqa: E402

TOKEN = "t0ken"
ROWS = 50

MODEL = textwrap.dedent(f"""
    import keras
    import numpy as np

    def model():
        ids = keras.Input(shape=(2,), dtype="int64", name="ids")
        x = keras.Input(shape=(3,), name="x")
        looked_up = keras.layers.Flatten()(keras.layers.Embedding({ROWS}, 4, name="table")(ids))
        return keras.Model({{"ids": ids, "x": x}}, keras.layers.Dense(1)(keras.layers.Concatenate()([looked_up, x])))

    def loss(labels, predictions):
        return keras.ops.mean(keras.ops.square(labels - predictions))   # labels come as [n, 1], as in fit

    def optimizer():
        return keras.optimizers.SGD(0.1)

    def feed(batch):
        x = np.stack([batch["a"], batch["b"], batch["c"]], axis=1).astype("float32")
        ids = np.stack([batch["u"], batch["v"]], axis=1).astype("int64")
        return {{"ids": ids, "x": x}}, batch["y"].astype("float32")
""")


BATCHNORM = textwrap.dedent("""
    import keras
    import numpy as np

    def model():
        return keras.Sequential([keras.Input(shape=(3,)), keras.layers.BatchNormalization(momentum=0.9),
                                 keras.layers.Dense(1)])

    def loss(labels, predictions):
        return keras.ops.mean(keras.ops.square(labels - predictions))

    def optimizer():
        return keras.optimizers.SGD(0.1)

    def feed(batch):
        return np.stack([batch["a"], batch["b"], batch["c"]], axis=1).astype("float32"), batch["y"].astype("float32")
""")


@pytest.fixture
def trainer(tmp_path):
    yield from serve(tmp_path, MODEL)


@pytest.fixture
def batchnorm_trainer(tmp_path):
    yield from serve(tmp_path, BATCHNORM)


def serve(tmp_path, source: str, **trainer_options):
    """A PSTrainer on a model defined by `source`, against one real shard on loopback gRPC."""
    (tmp_path / "model_def.py").write_text(source)
    model_def = load_model_def(str(tmp_path / "model_def.py"))
    keras.utils.set_random_seed(1)
    ps_model = model_def.model()
    placement = Placement.of(ps_model, 1)
    service = ParameterServerService(ParameterShard(ps_model, model_def.optimizer(), placement, 0), TOKEN)
    server = rpc.server(max_workers=4)
    pb_grpc.add_ParameterServerServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    keras.utils.set_random_seed(2)  # the worker's own initial values differ from the PS's
    model = model_def.model()
    ps = PSClient([f"127.0.0.1:{port}"], TOKEN, placement)
    t = PSTrainer(model_def, model, ps, placement, **trainer_options)
    t.set_dense(ps.pull_dense())
    yield t, ps, ps_model
    t.close()
    ps.close()
    server.stop(None)
    service.close()


def lease_rows(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "a": rng.normal(size=n),
        "b": rng.normal(size=n),
        "c": rng.normal(size=n),
        "u": rng.integers(0, ROWS, n),
        "v": rng.integers(0, ROWS, n),
        "y": rng.normal(size=n),
    }


def test_a_minibatch_is_the_records_it_names_and_pulls_exactly_their_rows(trainer):
    t, ps, ps_model = trainer
    rows = lease_rows(40)
    table = t.variables[t.table_names[0]]
    before = table.numpy().copy()
    lo, hi = 16, 24
    result = t.compute(t.minibatch(t.feed_lease(rows), lo, hi))

    wanted = np.unique(np.concatenate([rows["u"][lo:hi], rows["v"][lo:hi]]))
    on_ps = ps.pull_rows({t.table_names[0]: np.arange(ROWS)})[t.table_names[0]]
    after = table.numpy()
    np.testing.assert_array_equal(after[wanted], on_ps[wanted])
    others = np.setdiff1d(np.arange(ROWS), wanted)
    np.testing.assert_array_equal(after[others], before[others])  # nothing else was pulled

    # The loss is that of records [lo, hi) alone, at the PS's values (Keras on the same weights).
    ps_model.get_layer("table").embeddings.assign(on_ps)
    features = {
        "ids": np.stack([rows["u"], rows["v"]], 1)[lo:hi],
        "x": np.stack([rows["a"], rows["b"], rows["c"]], 1)[lo:hi],
    }
    expected = np.mean((rows["y"][lo:hi] - ps_model(features, training=False).numpy()[:, 0]) ** 2)
    assert float(result.loss) == pytest.approx(expected, rel=1e-5)
    # Only the looked-up rows carry gradients to the PS.
    ids, _values = result.sparse[0]
    np.testing.assert_array_equal(np.sort(ids.numpy()), wanted)


def test_minibatches_of_one_lease_share_its_tensors_and_one_traced_step(trainer):
    t, _ps, _ = trainer
    lease = t.feed_lease(lease_rows(40, seed=1))
    first, second = t.minibatch(lease, 0, 8), t.minibatch(lease, 8, 13)
    assert first.data is second.data and (first.bounds, second.bounds) == ((0, 8), (8, 13))
    t.compute(first)
    step = t._traced[1]
    t.compute(second)
    t.compute(t.minibatch(t.feed_lease(lease_rows(24, seed=2)), 0, 24))  # another lease, another size
    assert t._traced[1] is step


def test_a_refresh_takes_the_shards_values_now_and_older_replies_do_not_undo_it(trainer):
    t, ps, _ = trainer
    other = ps  # another worker's pushes: they move the shard on
    for seq in range(3):
        other.push(
            PushKey(99, seq, seq + 1, 0, 0),
            [np.full(t._flat_specs[0].shape[0], 0.01, np.float32)],
            {},
            want_dense=False,
        )
    ((version, now),) = ps.pull_dense_at()
    assert version == 3 and not np.array_equal(t._flats[0].numpy(), now)
    t.refresh_dense()
    np.testing.assert_array_equal(t._flats[0].numpy(), now)
    t._take_fresh([(2, np.zeros_like(now))])  # a reply from before the refresh arrives late
    np.testing.assert_array_equal(t._flats[0].numpy(), now)


def test_the_step_moves_the_ps_held_batchnorm_statistics_as_keras_moves_them(batchnorm_trainer):
    """BatchNormalization's moving mean and variance live on the PS: a push adds how the step changed
    them, so the PS holds what Keras's own training call leaves in a model with the PS's values."""
    t, ps, ps_model = batchnorm_trainer
    bn = ps_model.layers[0]
    witness = keras.models.clone_model(ps_model)
    named = ps.pull_dense_named()
    load_named(witness, named)  # the PS's values, before the push: mean 0, variance 1
    np.testing.assert_array_equal(witness.layers[0].moving_mean.numpy(), bn.moving_mean.numpy())

    rows = lease_rows(32, seed=3)
    rows["a"] = rows["a"] * 4 + 10  # far from mean 0 / variance 1: the update is visible
    result = t.compute(t.minibatch(t.feed_lease(rows), 0, 32))
    assert t.push_finish(t.push_start(result, PushKey(5, 0, 32, 0, 0)))[0]

    x = np.stack([rows["a"], rows["b"], rows["c"]], axis=1).astype("float32")
    witness(x, training=True)  # Keras's own update of the statistics, once
    after = ps.pull_dense_named()
    mean = next(v for n, v in after.items() if n.endswith("moving_mean"))
    variance = next(v for n, v in after.items() if n.endswith("moving_variance"))
    np.testing.assert_allclose(mean, witness.layers[0].moving_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(variance, witness.layers[0].moving_variance.numpy(), rtol=1e-5, atol=1e-6)
    assert mean[0] > 0.5  # (0.1 of a batch mean near 10)
    # The same push again changes nothing: the state is applied once, with its key.
    assert not t.push_finish(t.push_start(result, PushKey(5, 0, 32, 0, 0)))[0]
    np.testing.assert_array_equal(ps.pull_dense_named()[next(n for n in after if n.endswith("moving_mean"))], mean)


@pytest.mark.parametrize("source", [MODEL, BATCHNORM], ids=["embedding", "batchnorm"])
def test_a_push_of_several_minibatches_updates_as_kerass_gradient_accumulation(tmp_path, source):
    """--minibatches-per-push 3 on 20 records of minibatch 8: one push of the mean of three minibatches'
    gradients (8, 8 and 4 records), each taken at the same values, with batch norm's statistics moved
    once per minibatch. The witness is Keras's own fit of the same records with
    gradient_accumulation_steps=3 from the same values: the shard's values must be what it leaves."""
    for t, ps, ps_model in serve(tmp_path, source, minibatch_size=8, minibatches_per_push=3):
        witness = keras.models.clone_model(ps_model)
        before = ps.pull_dense_named()
        tables = {n: ps.pull_rows({n: np.arange(ROWS)})[n] for n in t.table_names}
        load_named(witness, {**before, **tables})

        rows = lease_rows(20, seed=4)
        rows["a"] = rows["a"] * 4 + 10  # batch norm's statistics move visibly
        result = t.compute(t.minibatch(t.feed_lease(rows), 0, 20))
        assert t.push_finish(t.push_start(result, PushKey(7, 0, 20, 0, 0)))[0]

        witness.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=3), loss=t.model_def.loss_fn)
        x, y = t.model_def.feed(rows)
        witness.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert int(witness.optimizer.iterations.numpy()) == 1  # three minibatches, one update

        expected = {n: v.numpy() for n, v in named_variables(witness).items()}
        after = {**ps.pull_dense_named(), **{n: ps.pull_rows({n: np.arange(ROWS)})[n] for n in t.table_names}}
        assert after.keys() == expected.keys()
        for name, value in after.items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
            assert not np.allclose(value, {**before, **tables}[name]), name  # the push moved it


def test_a_call_of_several_minibatches_leaves_the_shard_as_fit_leaves_it(tmp_path):
    """A model without tables: three minibatches (8, 8 and 4 records) in one call on the worker's copy of the
    shard, its update after each, then each pushed under its own key and applied in turn by the shard. The
    witness is Keras's fit of the same records at batch 8 from the same values: three updates, the shard's
    values must be what it leaves, and the copy, in step with the shard, is not re-pulled."""
    for t, ps, ps_model in serve(tmp_path, BATCHNORM, minibatch_size=8):
        assert t.local
        witness = keras.models.clone_model(ps_model)
        before = ps.pull_dense_named()
        load_named(witness, before)
        rows = lease_rows(20, seed=4)
        rows["a"] = rows["a"] * 4 + 10  # batch norm's statistics move visibly
        fed = t.feed_lease(rows)
        result = t.compute(t.minibatch(fed, 0, 20, [0, 8, 16]))
        each = t.push_finish_each(t.push_start(result, PushKey(7, 0, 20, 0, 0), [0, 8, 16, 20]))
        assert [applied for applied, _loss in each] == [True, True, True] and not t._resync
        assert ps.stats()[0].pushes_applied == 3  # one key each
        assert ps.stats()[0].states_taken == 1  # on one host the shard took the copy's state after them

        witness.compile(optimizer=keras.optimizers.SGD(0.1), loss=t.model_def.loss_fn)
        x, y = t.model_def.feed(rows)
        witness.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        expected = {n: v.numpy() for n, v in named_variables(witness).items()}
        after = ps.pull_dense_named()
        for name, value in after.items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
            assert not np.allclose(value, before[name]), name
        np.testing.assert_allclose(t._copies[0].values().numpy(), ps.pull_dense()[0], rtol=1e-6, atol=1e-7)
        # The same call pushed again (a lost worker's remainder, re-pushed): every key is skipped.
        each = t.push_finish_each(t.push_start(result, PushKey(7, 0, 20, 0, 0), [0, 8, 16, 20]))
        assert [applied for applied, _loss in each] == [False, False, False]
        np.testing.assert_array_equal(ps.pull_dense_named()[next(iter(after))], after[next(iter(after))])


def test_a_worker_is_alone_until_the_shards_versions_show_another_workers_push(caplog):
    """Each shard's version before and after this worker's pushes: only its own applied -> alone; more ->
    another worker pushed, not alone at once; alone again only after ALONE_AGAIN of its own minibatches in a
    row with no other's. What is not known (a version before a pull, a restored shard's) tells nothing."""
    caplog.set_level("INFO", logger="elastic_step.worker")
    c = Company()
    assert c.alone
    c.seen([5, 3], [8, 6], [3, 3], 3)  # its own 3 on each shard
    c.seen([8, 6], [8, 6], [0, 0], 3)  # a re-push, applied before: nothing moved
    assert c.alone and not caplog.records
    c.seen([8, 6], [11, 10], [3, 3], 3)  # shard 1 applied one more
    assert not c.alone
    assert "another worker pushed (shard 1 applied 1 push(es) besides this worker's)" in caplog.text
    for _ in range(ALONE_AGAIN - 1):
        c.seen([11, 10], [12, 11], [1, 1], 1)
    c.seen([12, 11], [14, 11], [0, 0])  # a pull: another pushed to shard 0 meanwhile, the count starts over
    for _ in range(ALONE_AGAIN - 1):
        c.seen([14, 11], [15, 12], [1, 1], 1)
        c.seen([-1, -1], [40, 40], [1, 1], 1)  # not known: no evidence either way
        c.seen([15, 12], [2, 2], [1, 1], 1)  # a restored shard counts from its checkpoint
    assert not c.alone
    c.seen([15, 12], [16, 13], [1, 1], 1)
    assert c.alone
    assert f"no other worker pushed during this worker's last {ALONE_AGAIN} minibatches" in caplog.text
    assert len(caplog.records) == 2  # once a switch


def test_a_worker_runs_one_minibatch_a_call_once_another_pushed_to_the_shard(tmp_path):
    """The trainer against a real shard: alone, its calls grow to several minibatches; a push under another
    worker's key between two of its own makes its next calls one minibatch, the step of a worker without
    copies on the shard's newest values (which its push's reply brings, the other's gradient included), its
    pushes in flight as without copies; once it has seen only its own pushes for long enough, the copies take
    the shard's values again and its calls are on them."""
    for t, ps, _ps_model in serve(tmp_path, BATCHNORM, minibatch_size=4):
        t.company = Company(again=2)
        fed = t.feed_lease(lease_rows(64, seed=5))

        def call(lo, n):
            starts = [lo + 4 * i for i in range(n)]
            result = t.compute(t.minibatch(fed, lo, lo + 4 * n, starts))
            key = PushKey(1, lo, lo + 4 * n, 0, 0)
            return t.push_finish_each(t.push_start(result, key, [*starts, lo + 4 * n]))

        call(0, 1)  # traces
        call(4, 1)  # timed
        assert t.minibatches_per_call(14, 16) > 1 and t.company.alone
        call(8, 2)
        assert t.company.alone  # its own pushes only
        taken = ps.stats()[0].states_taken
        assert taken == 3  # each call's state, the shard still where the call started
        other = PushKey(2, 0, 4, 0, 0)  # another worker's minibatch
        assert ps.push(other, [np.full(t._copies[0].dense_size, 0.5, np.float32)], {}, want_dense=False)[0]
        applied = ps.stats()[0].pushes_applied
        assert [a for a, _loss in call(16, 2)] == [True, True]
        # Past the call's start: the shard declined its state, then applied its gradients, each once.
        assert ps.stats()[0].states_taken == taken and ps.stats()[0].pushes_applied == applied + 2
        assert ps.stats()[0].pushes_skipped == 0
        assert not t.company.alone and t.minibatches_per_call(12, 16) == 1 and t.pushes_ahead(2) == 1
        np.testing.assert_allclose(t._flats[0].numpy(), ps.pull_dense()[0], rtol=1e-6, atol=1e-7)
        for lo in (24, 28):  # one-minibatch steps, as without copies; their pushes show no other's
            result = t.compute(t.minibatch(fed, lo, lo + 4))
            assert not result.on_copies and result.loss.shape == ()
            assert t.push_finish_each(t.push_start(result, PushKey(1, lo, lo + 4, 0, 0)))[0][0]
        assert t.company.alone and t.pushes_ahead(2) == 0  # the copies take the shard's values first
        assert [a for a, _loss in call(32, 2)] == [True, True] and t.company.alone and not t._resync
        assert ps.stats()[0].states_taken == taken + 1  # the copies pulled the shard's whole state again
        np.testing.assert_allclose(t._copies[0].values().numpy(), ps.pull_dense()[0], rtol=1e-6, atol=1e-7)


def test_a_refresh_asked_while_a_lone_workers_push_is_out_keeps_what_the_copies_hold(tmp_path):
    """A refresh asked for while a lone worker's push is out (as at a lease after a wait for work): once the push is
    back and shows only this worker's pushes, the copies are the shard's whole state already, and the next call's
    push still carries it, which the shard takes. Had another worker pushed meanwhile, the copies take the shard's
    values and their next push carries the gradients."""
    for t, ps, _ps_model in serve(tmp_path, BATCHNORM, minibatch_size=4):
        fed = t.feed_lease(lease_rows(64, seed=6))

        def start(lo, n, meanwhile=lambda: None):
            starts = [lo + 4 * i for i in range(n)]
            result = t.compute(t.minibatch(fed, lo, lo + 4 * n, starts))
            meanwhile()
            return t.push_start(result, PushKey(1, lo, lo + 4 * n, 0, 0), [*starts, lo + 4 * n])

        for lo in (0, 4):  # traces, then timed
            t.push_finish_each(start(lo, 1))
        taken = ps.stats()[0].states_taken
        out = start(8, 2)
        t.refresh_dense()  # asked while the push is out: after it
        assert [a for a, _loss in t.push_finish_each(out)] == [True, True] and not t._resync
        t.push_finish_each(start(16, 2))
        assert ps.stats()[0].states_taken == taken + 2  # both calls' states: the copies kept theirs
        np.testing.assert_allclose(t._copies[0].values().numpy(), ps.pull_dense()[0], rtol=1e-6, atol=1e-7)

        other = PushKey(2, 0, 4, 0, 0)  # another worker's minibatch, before this one's push
        out = start(24, 2, lambda: ps.push(other, [np.full(t._copies[0].dense_size, 0.5, np.float32)], {}))
        t.refresh_dense()
        t.push_finish_each(out)
        assert t._base == [None]  # the copies took the shard's values, not its optimizer state
        np.testing.assert_allclose(t._copies[0].values().numpy(), ps.pull_dense()[0], rtol=1e-6, atol=1e-7)


WEIGHTED = textwrap.dedent("""
    import keras
    import numpy as np

    def model():
        x = keras.Input(shape=(3,), name="x")
        word = keras.Input(shape=(1,), dtype="string", name="word")
        hashed = keras.layers.Hashing(num_bins=4, output_mode="one_hot")(word)
        return keras.Model([x, word], keras.layers.Dense(1)(keras.layers.Concatenate()([x, hashed])))

    def loss(labels, predictions):
        return keras.ops.square(labels - predictions)  # per example: fit weighs each by its sample weight

    def optimizer():
        return keras.optimizers.SGD(0.1)

    def feed(batch):  # a tuple of inputs, one of them strings (numpy)
        x = np.stack([batch["a"], batch["b"], batch["c"]], axis=1).astype("float32")
        return (x, batch["word"].reshape(-1, 1)), batch["y"].astype("float32").reshape(-1, 1)
""")


def weighted_rows(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    rows = lease_rows(n)
    rows["word"] = rng.choice(np.array(["red", "green", "blue"], dtype=object), n)
    rows["w"] = rng.uniform(0, 3, n)
    return rows


def keras_weighted_loss(net, rows, lo, hi, weights):
    x = np.stack([rows["a"], rows["b"], rows["c"]], 1).astype("float32")[lo:hi]
    p = net((tf.constant(x), tf.constant(rows["word"][lo:hi].astype(str).reshape(-1, 1))), training=False).numpy()
    return float(np.sum(weights[lo:hi] * (rows["y"][lo:hi] - p[:, 0]) ** 2) / (hi - lo))


def assert_step_loss_is_keras(tmp_path, source, rows, lo, hi, weights, **options) -> None:
    """The loss of records [lo, hi) of `rows`, as a trainer on the model `source` computes it, is Keras's loss of
    them with these sample weights."""
    gen = serve(tmp_path, source, **options)
    t, _ps, ps_model = next(gen)
    try:
        result = t.compute(t.minibatch(t.feed_lease(rows), lo, hi))
        (loss,) = np.ravel(result.loss)  # a call of one minibatch (a model without tables: one loss each)
        assert float(loss) == pytest.approx(keras_weighted_loss(ps_model, rows, lo, hi, weights), rel=1e-5)
    finally:
        gen.close()


def test_a_weight_column_weighs_each_records_loss_as_fits_sample_weight(tmp_path):
    """The data's weight column (named at prep) is each record's sample weight in the step, with inputs
    given as a tuple that holds strings; without it, every record weighs 1."""
    rows = weighted_rows(40)
    lo, hi = 8, 24
    for column, weights in (("w", rows["w"]), (None, np.ones(40))):
        assert_step_loss_is_keras(tmp_path, WEIGHTED, rows, lo, hi, weights, weight_column=column)


def test_feed_may_return_sample_weights_and_class_weight_weighs_by_label(tmp_path):
    """feed()'s (x, y, sample_weight), as fit takes a dataset's elements; class_weight(), as
    fit(class_weight=...): the same loss as the equivalent sample weights."""
    rows = weighted_rows(40)
    classes = np.arange(40) % 3
    rows["y"] = classes.astype(float)
    lo, hi = 4, 36
    by_feed = WEIGHTED.replace(
        'batch["y"].astype("float32").reshape(-1, 1)', 'batch["y"].astype("float32").reshape(-1, 1), batch["w"]'
    )
    by_class = WEIGHTED + "\ndef class_weight():\n    return {0: 0.5, 2: 4.0}\n"
    for source, weights in ((by_feed, rows["w"]), (by_class, np.array([0.5, 1.0, 4.0])[classes])):
        assert_step_loss_is_keras(tmp_path, source, rows, lo, hi, weights)


def test_a_minibatch_whose_loss_is_not_finite_is_never_pushed_and_names_its_records(trainer):
    """As Keras's TerminateOnNaN: a NaN in a label makes the loss NaN; the job must stop on it, with the records
    to look at, before the shard's values hold it (one NaN applied makes every value NaN)."""
    t, ps, _ = trainer
    before = ps.pull_dense()
    rows = lease_rows(32, seed=5)
    rows["y"][20] = np.nan
    result = t.compute(t.minibatch(t.feed_lease(rows), 16, 32), "records [16, 32) of part-0 in epoch 2")
    with pytest.raises(DataError) as raised:
        t.push_finish(t.push_start(result, PushKey(9, 16, 32, 1, 0)))
    assert "the loss became nan on records [16, 32) of part-0 in epoch 2" in str(raised.value), raised.value
    assert "data prep" in str(raised.value) and "learning rate" in str(raised.value)
    for a, b in zip(ps.pull_dense(), before):
        np.testing.assert_array_equal(a, b)
    # The records before it are finite: they push.
    result = t.compute(t.minibatch(t.feed_lease(rows), 0, 16))
    assert t.push_finish(t.push_start(result, PushKey(9, 0, 16, 1, 0)))[0]


def test_skipping_a_minibatch_whose_loss_is_not_finite_applies_nothing_of_it_and_tells_the_master(tmp_path):
    """--skip-non-finite: the shards get the mark of a skipped minibatch (they apply nothing, account for its
    records as skipped) and the master is told which records and why."""
    told = []
    skip = NonFinite(True, lambda at, why: told.append((at, why)))
    for t, ps, _ps_model in serve(tmp_path, MODEL, non_finite=skip):
        before = ps.pull_dense()
        rows = lease_rows(32, seed=5)
        rows["y"][20] = np.nan
        at = Records("part-0", 0, 1, 16, 32)
        result = t.compute(t.minibatch(t.feed_lease(rows), 16, 32), at)
        applied, loss = t.push_finish(t.push_start(result, PushKey(9, 16, 32, 1, 0)))
        assert applied and loss != loss  # accounted for; its loss is NaN, which the master leaves out
        assert told == [(at, "the loss became nan")]
        for a, b in zip(ps.pull_dense(), before):
            np.testing.assert_array_equal(a, b)
        evidence = tensors.decode_applied(ps.stats()[0].applied)  # what the audit reads
        assert {k: v.tolist() for k, v in evidence.items()} == {skipped_key(1, 0): [[16, 32]]}


def test_with_one_push_in_flight_the_push_is_applied_before_the_next_step_and_its_error_kept_for_finish(tmp_path):
    """One push in flight: the worker waits for it before its next step anyway, so it goes on the calling thread
    (no push thread to switch to and back); a push that fails still fails where the loop collects it."""
    for t, ps, _ps_model in serve(tmp_path, MODEL, pushes_in_flight=1):
        rows = lease_rows(32, seed=6)
        fed = t.feed_lease(rows)
        before = ps.pull_dense()
        handle = t.push_start(t.compute(t.minibatch(fed, 0, 16)), PushKey(4, 0, 16, 0, 0))
        assert handle.done()
        assert any(not np.array_equal(a, b) for a, b in zip(ps.pull_dense(), before))  # applied already
        assert t.push_finish(handle)[0]
        rows["y"][20] = np.nan
        handle = t.push_start(
            t.compute(t.minibatch(t.feed_lease(rows), 16, 32), "records [16, 32)"), PushKey(4, 16, 32, 0, 0)
        )
        with pytest.raises(DataError):
            t.push_finish(handle)


def test_a_call_skips_a_minibatch_that_is_not_finite_and_applies_the_others_in_turn(tmp_path):
    """--skip-non-finite, several minibatches a call: the copy skips the middle one (not finite) as the shard does,
    the others are applied in turn under their keys, and the skipped one is accounted for as skipped."""
    told = []
    skip = NonFinite(True, lambda at, why: told.append((at, why)))
    for t, ps, _ps_model in serve(tmp_path, BATCHNORM, minibatch_size=8, non_finite=skip):
        rows = lease_rows(24, seed=7)
        rows["y"][12] = np.nan
        at = Records("part-0", 0, 0, 0, 24)
        result = t.compute(t.minibatch(t.feed_lease(rows), 0, 24, [0, 8, 16]), at)
        each = t.push_finish_each(t.push_start(result, PushKey(3, 0, 24, 0, 0), [0, 8, 16, 24]))
        assert [applied for applied, _ in each] == [True, True, True] and each[1][1] != each[1][1]  # NaN loss
        assert told == [(Records("part-0", 0, 0, 8, 16), "the loss became nan")]
        (values,) = ps.pull_dense()
        assert np.isfinite(values).all()
        np.testing.assert_allclose(t._copies[0].values().numpy(), values, rtol=1e-6, atol=1e-7)
        evidence = tensors.decode_applied(ps.stats()[0].applied)
        expected = {(0, 0): [[0, 8], [16, 24]], skipped_key(0, 0): [[8, 16]]}
        assert {k: v.tolist() for k, v in evidence.items()} == expected


def test_after_a_checkpoint_a_lone_worker_pulls_only_when_the_cuts_versions_are_not_its_own(tmp_path):
    """The master tells the held workers each shard's version at the cut. A lone worker's copies at exactly
    those versions have nothing to pull; at any other versions it pulls. The witness is another worker's push
    (straight to the shard): the copies take its values only when the worker pulled."""
    for t, ps, _ps_model in serve(tmp_path, BATCHNORM, minibatch_size=8):
        fed = t.feed_lease(lease_rows(16, seed=5))
        t.push_finish_each(
            t.push_start(t.compute(t.minibatch(fed, 0, 16, [0, 8])), PushKey(7, 0, 16, 0, 0), [0, 8, 16])
        )
        mine = list(t._expect)
        assert t._on_copies() and mine == [2]
        other = np.full(t._copies[0].values().shape[0], 0.01, np.float32)
        ps.push(PushKey(99, 0, 1, 0, 0), [other], {}, want_dense=False)  # after the cut: not in `mine`
        copy = t._copies[0].values().numpy()
        t.refresh_dense(unless_at=mine)
        np.testing.assert_array_equal(t._copies[0].values().numpy(), copy)  # nothing pulled
        ((version, now),) = ps.pull_dense_at()
        t.refresh_dense(unless_at=[version])
        np.testing.assert_array_equal(t._copies[0].values().numpy(), now)  # pulled: the other's push is in


DENSE = textwrap.dedent("""
    import keras
    import numpy as np

    SCALE = 65536.0  # the worker's first minibatch overflows float16 at it, the next ones at half of it do not

    def model():
        layers = [keras.Input(shape=(3,)), keras.layers.Dense(4), keras.layers.Dense(1, dtype="float32")]
        return keras.Sequential(layers)

    def loss(labels, predictions):
        return keras.ops.mean(keras.ops.square(labels - predictions))

    def optimizer():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=SCALE)

    def feed(batch):
        return np.stack([batch["a"], batch["b"], batch["c"]], axis=1).astype("float32"), batch["y"].astype("float32")
""")


def serve_mixed_float16(tmp_path, source: str, **trainer_options):
    """`serve`, the models built in Keras's mixed_float16 policy (the policy is then theirs)."""
    keras.config.set_dtype_policy("mixed_float16")
    try:
        served = serve(tmp_path, source, **trainer_options)
        yield next(served)
    finally:
        keras.config.set_dtype_policy("float32")
    yield from served


@pytest.mark.parametrize("per_push", [1, 3], ids=["a minibatch", "a group of them"])
def test_a_step_loss_scaling_skips_is_trained_applies_nothing_and_is_no_failure(tmp_path, per_push):
    """mixed_float16 at a loss scale no float16 gradient survives: Keras's LossScaleOptimizer skips the step (its
    batch consumed). The push applies nothing, its records are trained, not skipped, and, though the gradient is
    not finite, it is neither a failure nor a --skip-non-finite skip. With --minibatches-per-push, the group's."""
    told = []
    source = MODEL.replace(
        "keras.optimizers.SGD(0.1)", "keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), 1e30)"
    )
    skip = NonFinite(True, lambda *a: told.append(a))
    options = {"non_finite": skip, "minibatch_size": 8, "minibatches_per_push": per_push}
    for t, ps, _ps_model in serve_mixed_float16(tmp_path, source, **options):
        assert t.loss_scaled and not t.local  # a model with a table: one minibatch a step
        before = ps.pull_dense()
        result = t.compute(t.minibatch(t.feed_lease(lease_rows(32, seed=5)), 16, 32), Records("part-0", 0, 1, 16, 32))
        applied, loss = t.push_finish(t.push_start(result, PushKey(9, 16, 32, 1, 0)))
        assert applied and np.isfinite(loss) and told == []
        for a, b in zip(ps.pull_dense(), before):
            np.testing.assert_array_equal(a, b)
        evidence = tensors.decode_applied(ps.stats()[0].applied)  # what the audit reads
        assert {k: v.tolist() for k, v in evidence.items()} == {(1, 0): [[16, 32]]}


def test_a_call_under_loss_scaling_leaves_the_shard_as_fit_leaves_it(tmp_path):
    """mixed_float16, three minibatches in one call on the worker's copy of the shard: the first overflows at the
    initial scale and is skipped, the scale halves, the others are applied, unscaled. The witness is Keras's fit
    of the same records at batch 8 with the same LossScaleOptimizer, from the same values."""
    for t, ps, ps_model in serve_mixed_float16(tmp_path, DENSE, minibatch_size=8):
        assert t.local and t.loss_scaled
        witness = keras.models.clone_model(ps_model)
        before = ps.pull_dense_named()
        load_named(witness, before)
        rows = lease_rows(20, seed=4)
        result = t.compute(t.minibatch(t.feed_lease(rows), 0, 20, [0, 8, 16]))
        each = t.push_finish_each(t.push_start(result, PushKey(7, 0, 20, 0, 0), [0, 8, 16, 20]))
        assert [applied for applied, _loss in each] == [True, True, True]
        assert all(np.isfinite(loss) for _applied, loss in each)
        evidence = tensors.decode_applied(ps.stats()[0].applied)
        assert {k: v.tolist() for k, v in evidence.items()} == {(0, 0): [[0, 20]]}  # every record trained once

        witness.compile(optimizer=t.model_def.module.optimizer(), loss=t.model_def.loss_fn)
        x, y = t.model_def.feed(rows)
        witness.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert int(witness.optimizer.iterations.numpy()) == 2  # fit skipped one step too
        expected = {n: v.numpy() for n, v in named_variables(witness).items()}
        after = ps.pull_dense_named()
        for name, value in after.items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-3, atol=1e-4, err_msg=name)
            assert not np.allclose(value, before[name]), name
