"""ModelDef.training_loss: the stateless form (weights given as tensors, as PS workers run their step)
is the same loss, regularization and batch-norm statistics included, as the model called on its variables."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from elastic_step.errors import ModelDefError  # noqa: E402
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


FEED = textwrap.dedent("""
    import keras
    import numpy as np

    def model():
        return keras.Sequential([keras.Input(shape=(1,)), keras.layers.Dense(3)])

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def optimizer():
        return keras.optimizers.SGD(0.1)

    def feed(batch):
        return RESULT
""")


def module(tmp_path, result: str, extra: str = ""):
    path = tmp_path / f"m{abs(hash((result, extra)))}.py"
    path.write_text(FEED.replace("RESULT", result) + extra)
    return load_model_def(str(path))


BATCH = {"x": np.arange(6.0), "y": np.array([0, 1, 2, 2, 1, 0]), "w": np.linspace(0.5, 3, 6)}


def test_feed_returns_what_fit_takes_from_a_dataset(tmp_path):
    x, y, w = module(tmp_path, '(batch["x"], batch["y"])').examples(BATCH)
    assert w is None and y is BATCH["y"]
    _, _, w = module(tmp_path, '[batch["x"], batch["y"], batch["w"]]').examples(BATCH)
    assert w is BATCH["w"]
    _, _, w = module(tmp_path, '(batch["x"], batch["y"])').examples(BATCH, weight_column="w")
    np.testing.assert_array_equal(w, BATCH["w"].astype(np.float32))
    for wrong in ('batch["x"]', '(batch["x"],)', '(batch["x"], None)', '(batch["x"], batch["y"], 1, 2)'):
        with pytest.raises(
            ModelDefError, match=r"feed\(\) in the model definition .* must return \(features, labels\)"
        ):
            module(tmp_path, wrong).examples(BATCH)


@pytest.mark.parametrize("shape", ["sparse", "column", "one_hot", "float"])
def test_class_weight_weighs_each_record_as_fit_does(tmp_path, shape):
    from keras.src.trainers.data_adapters.data_adapter_utils import class_weight_to_sample_weights

    labels = {
        "sparse": 'batch["y"]',
        "column": 'batch["y"].reshape(-1, 1)',
        "one_hot": 'np.eye(3)[batch["y"]]',
        "float": 'batch["y"] + 0.2',
    }[shape]
    classes = {0: 0.25, 2: 4.0}  # class 1: not given, weighs 1
    md = module(tmp_path, f'(batch["x"], {labels})', f"\ndef class_weight():\n    return {classes}\n")
    _, y, weights = md.examples(BATCH)
    np.testing.assert_array_equal(weights, class_weight_to_sample_weights(y, classes))
    assert md.examples(BATCH, training=False)[2] is None  # evaluate() takes no class weights


def test_weights_from_two_sources_at_once_are_refused_as_fit_refuses_them(tmp_path):
    weighted = '(batch["x"], batch["y"], batch["w"])'
    with pytest.raises(ModelDefError, match="weight column 'w'.*Use one"):
        module(tmp_path, weighted).examples(BATCH, weight_column="w")
    with pytest.raises(ModelDefError, match=r"class_weight\(\).*sample weights \(from feed\(\)\)"):
        module(tmp_path, weighted, "\ndef class_weight():\n    return {0: 2.0}\n").examples(BATCH)
    with pytest.raises(ModelDefError, match=r"class_weight\(\) in .* must return a dict of class index"):
        module(tmp_path, '(batch["x"], batch["y"])', "\ndef class_weight():\n    return [1.0, 2.0]\n").examples(BATCH)


def test_training_loss_weighs_records_through_the_losss_own_reduction(tmp_path):
    md = module(tmp_path, '(batch["x"], batch["y"])')
    net = md.model()
    x = BATCH["x"].reshape(-1, 1).astype(np.float32)
    net.compile(loss=md.module.loss)
    expected = net.compute_loss(x, BATCH["y"], net(x), sample_weight=BATCH["w"])
    got = md.training_loss(net, x, BATCH["y"], BATCH["w"])
    assert float(got) == pytest.approx(float(expected), rel=1e-6)
    assert abs(float(got) - float(md.training_loss(net, x, BATCH["y"]))) > 1e-3


LABELS_MODEL = textwrap.dedent("""
    import keras

    def model():
        x = keras.Input(shape=(4,))
        return keras.Model(x, keras.layers.Dense(3)(x))

    def loss(labels, predictions):
        return per_example(labels, predictions)

    def per_example(labels, predictions):
        return keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)

    def optimizer():
        return keras.optimizers.SGD(0.1)

    def feed(batch):
        return batch["x"], batch["y"]
""")


def labels_model(tmp_path):
    path = tmp_path / "labels.py"
    path.write_text(LABELS_MODEL)
    return load_model_def(str(path)), str(path)


def test_an_op_that_fails_in_a_compiled_step_is_told_in_tensorflows_words_with_the_users_frames(tmp_path):
    md, path = labels_model(tmp_path)
    m = md.model()

    @tf.function
    def step(x, y):
        return md.training_loss(m, x, y)

    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        step(np.zeros((4, 4), np.float32), np.array([0, 1, 2, 12]))
    assert str(raised.value).startswith("Graph execution error")  # what there is to undo
    text = str(md.user_error(raised.value, "computing a training step", where="records [0, 4)"))
    first = text.splitlines()[0]
    assert first.startswith(f"loss() in the model definition {path!r} raised InvalidArgumentError"), first
    assert (
        "while computing a training step on records [0, 4): Received a label value of 12 which is outside the "
        "valid range of [0, 3)" in first
    ), first
    assert "Graph execution" not in text and "{{node" not in text and "[Op:" not in text, text
    # The user's frames from where the op was defined, outermost first, and nobody else's.
    frames = text.split("Your code, innermost last:\n")[1]
    assert frames.index("in loss") < frames.index("in per_example"), frames
    assert "return per_example(labels, predictions)" in frames  # the source line, as a traceback shows it
    assert "elastic_step" not in frames and "keras" not in frames.replace("keras.losses", ""), frames
    assert "Check those records and what feed() returns for them, and loss()" in text


def test_an_op_that_fails_eagerly_loses_tensorflows_framing_too(tmp_path):
    md, path = labels_model(tmp_path)
    m = md.model()
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        md.loss_fn(np.array([0, 12]), m(np.zeros((2, 4), np.float32)))
    first = str(md.user_error(raised.value, "evaluating the model")).splitlines()[0]
    assert (
        "raised InvalidArgumentError while evaluating the model: Received a label value of 12 which is outside the "
        "valid range of [0, 3).  Label values: 0 12. Check those records" in first
    ), first


def test_a_python_error_while_tracing_names_the_function_and_its_frames(tmp_path):
    md, path = labels_model(tmp_path)
    md.module.per_example = lambda labels, predictions: {}["class weights"]
    m = md.model()

    @tf.function
    def step(x, y):
        return md.training_loss(m, x, y)

    with pytest.raises(KeyError) as raised:
        step(np.zeros((4, 4), np.float32), np.array([0, 1, 2, 1]))
    text = str(md.user_error(raised.value, "computing a training step"))
    assert text.startswith(
        f"loss() in the model definition {path!r} raised KeyError while computing a training step: 'class weights'"
    ), text
    assert "Fix loss() in that module" in text and "in loss" in text.split("Your code")[1]


def test_a_model_definition_read_from_a_uri_is_copied_for_the_process_and_removed_at_its_exit(tmp_path):
    # A process of its own, so that its exit (the atexit handlers) runs; TMPDIR: where its copy goes.
    program = textwrap.dedent("""
        import pathlib, sys
        import fsspec
        from elastic_step.model_def import load_model_def

        with fsspec.open("memory://bucket/user_model.py", "w") as f:
            f.write(sys.argv[1])
        md = load_model_def("memory://bucket/user_model.py")
        copies = list(pathlib.Path(sys.argv[2]).glob("elastic-step-model-*/user_model.py"))
        assert len(copies) == 1 and copies[0].read_text() == sys.argv[1], copies
        print(md.model().count_params())
    """)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", program, MODEL, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split()[-1]) > 0  # the model built from the copy
    assert not list(tmp_path.glob("elastic-step-model-*"))


OVERRIDES = textwrap.dedent("""
    class Custom(keras.Model):
        def METHOD(self, *args, **kwargs):
            raise AssertionError("never run")

    _plain = model

    def model():
        plain = _plain()
        return Custom(plain.inputs, plain.outputs)
""")


@pytest.mark.parametrize(
    "method, instead",
    [("train_step", "override compute_loss()"), ("test_step", "compute_loss()"), ("compute_metrics", "eval_metrics()")],
)
def test_a_model_overriding_a_step_elastic_step_runs_is_refused_naming_the_method_and_what_to_do(
    tmp_path, method, instead
):
    path = tmp_path / f"{method}.py"
    path.write_text(MODEL + OVERRIDES.replace("METHOD", method))
    with pytest.raises(ModelDefError, match=rf"overrides {method}\(\) \(Custom\.{method}\).*{re.escape(instead)}"):
        load_model_def(str(path)).model()


def test_a_compute_loss_override_is_what_training_and_evaluation_minimise(tmp_path):
    """As in fit and evaluate: the override's loss, in the stateful step (allreduce), the stateless one (ps) and
    the evaluation alike."""
    from elastic_step.evaluation import EvalBatch, evaluate_batches

    path = tmp_path / "penalized.py"
    path.write_text(
        MODEL
        + textwrap.dedent("""
        class Penalized(keras.Model):
            def compute_loss(self, x, y, y_pred, sample_weight=None, training=True):
                return super().compute_loss(x, y, y_pred, sample_weight, training) + 100.0

        _plain = model

        def model():
            plain = _plain()
            return Penalized(plain.inputs, plain.outputs)
    """)
    )
    md = load_model_def(str(path))
    net = md.model()
    x, y = np.random.default_rng(0).normal(size=(8, 4)).astype("float32"), np.array([0, 1] * 4)
    net.compile(loss=md.module.loss)
    expected = float(net.evaluate(x, y, verbose=0))  # Keras's own, the override included
    assert expected > 100
    assert evaluate_batches(net, md, [EvalBatch(x, y, None, 8)])["loss"] == pytest.approx(expected, rel=1e-6)
    values = [v.value for v in net.trainable_variables]
    assert float(md.training_loss(net, x, y)) > 100
    assert float(md.training_loss(net, x, y, trainable_values=values)) > 100


def test_a_loss_per_output_must_be_a_loss_each(tmp_path):
    path = tmp_path / "heads.py"
    path.write_text(MODEL + '\nloss = {"a": keras.losses.MeanSquaredError(), "b": "not a loss"}\n')
    with pytest.raises(ModelDefError, match=r"loss\['b'\] .* is a str: each output's loss must be a function"):
        load_model_def(str(path))


def test_loss_scaling_is_fits_a_mixed_float16_models_or_the_loss_scale_optimizers(tmp_path):
    """As compile() decides it: a mixed_float16 model gets Keras's default loss scaling, an optimizer() returning a
    LossScaleOptimizer its own; the gradients are applied by the optimizer it wraps (the workers scale the loss)."""
    path = tmp_path / "half.py"
    path.write_text(
        MODEL.replace("x = keras.Input", 'keras.config.set_dtype_policy("mixed_float16")\n    x = keras.Input')
        + "\n\ndef scaled():\n    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), 1024.0, 7)\n"
    )
    md = load_model_def(str(path))
    try:
        half = md.model()
    finally:
        keras.config.set_dtype_policy("float32")
    (tmp_path / "full.py").write_text(MODEL)
    full = load_model_def(str(tmp_path / "full.py")).model()
    half.compile(optimizer=md.module.optimizer(), loss="mse")  # what fit does with it
    defaults = half.optimizer
    assert isinstance(defaults, keras.optimizers.LossScaleOptimizer)
    assert md.loss_scaling(half) == (defaults.initial_scale, defaults.dynamic_growth_steps)
    assert md.loss_scaling(full) is None
    md.module.optimizer = md.module.scaled
    assert md.loss_scaling(full) == (1024.0, 7) and md.loss_scaling(half) == (1024.0, 7)
    assert type(md.optimizer()) is keras.optimizers.SGD


def test_a_model_taking_the_statistics_gets_the_training_datas_and_needs_them(tmp_path):
    from elastic_step.data.prep import prepare

    (tmp_path / "d.csv").write_text("x,y\n" + "".join(f"{i / 10},{i % 2}\n" for i in range(40)))
    r = prepare(str(tmp_path / "d.csv"), str(tmp_path / "out"), label="y")
    path = tmp_path / "stats.py"
    path.write_text(MODEL.replace("def model():", "def model(statistics):\n    global SEEN\n    SEEN = statistics"))
    from elastic_step.data import statistics_of

    load_model_def(str(path), statistics_of(r.train_uri)).model()
    module = sys.modules[next(k for k, m in sys.modules.items() if getattr(m, "__file__", None) == str(path))]
    assert module.SEEN["x"]["count"] == r.train.total_rows
    with pytest.raises(ModelDefError, match=r"takes the data's statistics, and no training data was given"):
        load_model_def(str(path)).model()
