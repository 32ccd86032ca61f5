"""The step's evaluation against Keras's evaluate() on the same weights, for what the parity modules do
not cover: records weighed by a weight column named at prep; and records read once, evaluated again and again."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from elastic_step.data.prep import prepare  # noqa: E402
from elastic_step.data.reader import read_all  # noqa: E402
from elastic_step.evaluation import eval_batches, evaluate, evaluate_batches  # noqa: E402
from elastic_step.model_def import load_model_def  # noqa: E402

MODEL = textwrap.dedent("""
    import keras
    import numpy as np

    def model():
        return keras.Sequential([keras.Input(shape=(2,)), keras.layers.Dense(3)])

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def optimizer():
        return keras.optimizers.SGD(0.1)

    def feed(batch):
        return np.stack([batch["a"], batch["b"]], 1).astype("float32"), batch["label"]

    def eval_metrics():
        return {"accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy")}
""")


def test_a_weight_column_weighs_the_loss_as_evaluates_sample_weight(tmp_path):
    rng = np.random.default_rng(0)
    lines = [
        f"{a},{b},{c},{w}\n"
        for a, b, c, w in zip(rng.normal(size=60), rng.normal(size=60), rng.integers(0, 3, 60), rng.uniform(0, 4, 60))
    ]
    (tmp_path / "d.csv").write_text("a,b,label,w\n" + "".join(lines))
    r = prepare(str(tmp_path / "d.csv"), str(tmp_path / "out"), label="label", weight_column="w", eval_fraction=0.5)
    (tmp_path / "m.py").write_text(MODEL)
    md = load_model_def(str(tmp_path / "m.py"))
    keras.utils.set_random_seed(0)
    net = md.model()
    net.compile(loss=md.module.loss, metrics=list(md.eval_metrics().values()))
    rows = read_all(r.eval_uri)
    x, y = md.feed(rows)
    expected = net.evaluate(x, y, sample_weight=rows["w"], batch_size=8, verbose=0, return_dict=True)
    unweighted = net.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    got = evaluate(net, md, r.eval, batch_size=8)
    assert {m: got[m] for m in expected} == pytest.approx(expected, rel=1e-5)
    assert abs(got["loss"] - unweighted["loss"]) > 1e-3


def test_records_read_once_evaluate_as_evaluate_does_with_the_metrics_used_again(tmp_path):
    """The master's eval curve reads its records once and evaluates them after epoch upon epoch with the same
    metric objects: each time what evaluate(limit=...) reports on those weights, to the last bit."""
    rng = np.random.default_rng(1)
    rows = [f"{a},{b},{c}\n" for a, b, c in zip(rng.normal(size=200), rng.normal(size=200), rng.integers(0, 3, 200))]
    (tmp_path / "d.csv").write_text("a,b,label\n" + "".join(rows))
    r = prepare(str(tmp_path / "d.csv"), str(tmp_path / "out"), label="label", eval_fraction=0.5, shard_rows=40)
    assert len(r.eval.shards) >= 2  # a limit that cuts into the second shard, mid-way
    (tmp_path / "m.py").write_text(MODEL)
    md = load_model_def(str(tmp_path / "m.py"))
    keras.utils.set_random_seed(0)
    net = md.model()
    batches = list(eval_batches(md, r.eval, batch_size=16, limit=50))
    metrics = md.eval_metrics()
    for _ in range(2):
        expected = evaluate(net, md, r.eval, batch_size=16, limit=50)
        assert 50 <= expected["records"] < r.eval.total_rows
        assert evaluate_batches(net, md, batches, metrics) == expected
        net.set_weights([w + 0.5 for w in net.get_weights()])  # the next epoch's weights


def test_a_gate_picks_one_outputs_metric_of_a_model_with_two_heads(tmp_path, digits_data):
    """evaluate_op on the two-headed sample: the total loss and each output's, as evaluate() reports them, and
    the gate on `digit_accuracy`."""
    from elastic_step.model_io import save_model
    from elastic_step.steps import evaluate_step
    from tests.integration.harness import TWO_HEADS_MODEL

    md = load_model_def(TWO_HEADS_MODEL)
    keras.utils.set_random_seed(0)
    net = md.model()
    save_model(net, str(tmp_path / "model"))
    net.compile(
        loss=md.module.loss,
        loss_weights=md.loss_weights,
        metrics={"digit": [*md.module.eval_metrics()["digit"].values()]},
    )
    x, y = md.feed(read_all(digits_data["eval"]))
    expected = net.evaluate(x, y, batch_size=1024, verbose=0, return_dict=True)
    assert set(expected) == {"loss", "digit_loss", "big_loss", "digit_accuracy"}
    got = evaluate_step(
        str(tmp_path / "model"), digits_data["eval"], TWO_HEADS_MODEL, metric="digit_accuracy", threshold=0.5
    )
    assert got["metrics"] == pytest.approx({**expected, "records": len(y["digit"])}, rel=1e-5)
    assert got["score"] == pytest.approx(expected["digit_accuracy"]) and got["passed"] is False
