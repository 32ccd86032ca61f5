"""The data is checked against the model, and the eval data against the training data, through the model's feed()
before any instance starts."""

from __future__ import annotations

import logging

import pytest

from elastic_step.data.prep import prepare
from elastic_step.errors import DataError, ModelDefError
from elastic_step.master.data_check import check_splits
from elastic_step.model_def import load_model_def

MODEL = """
import keras
import numpy as np

def model():
    return keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

def optimizer():
    return keras.optimizers.SGD(0.1)

def feed(batch):
    return np.stack([batch["a"], batch["b"]], axis=1), batch["label"]
"""


def split(tmp_path, name: str, header: str, row) -> tuple:
    src = tmp_path / f"{name}.csv"
    src.write_text(header + "\n" + "".join(row(i) + "\n" for i in range(20)))
    r = prepare(str(src), str(tmp_path / name), label="label")
    return r.train, r.eval


FUSSY_FEED = """def feed(batch):
    if (batch["a"] < 0).any():
        raise ValueError("a is negative")
"""


def load(tmp_path, text: str):
    path = tmp_path / f"model_{abs(hash(text))}.py"
    path.write_text(text)
    return load_model_def(str(path))


@pytest.fixture
def model_def(tmp_path):
    return load(tmp_path, MODEL)


def test_matching_splits_pass(tmp_path, model_def):
    train, eval_ = split(tmp_path, "d", "a,b,label", lambda i: f"{i / 20},{i % 3},{i % 2}")
    check_splits(model_def, train, eval_)
    check_splits(model_def, train, None)


def test_a_column_the_eval_data_lacks_is_blamed_on_the_data_naming_the_columns(tmp_path, model_def):
    train, _ = split(tmp_path, "t", "a,b,label", lambda i: f"{i / 20},{i % 3},{i % 2}")
    _, eval_ = split(tmp_path, "e", "a,c,label", lambda i: f"{i / 20},{i % 3},{i % 2}")
    with pytest.raises(DataError) as e:
        check_splits(model_def, train, eval_)
    text = str(e.value)
    assert text.startswith("feed() takes the training data's records but not the eval data's: it raised KeyError")
    assert "the eval data lacks 'b'; only the eval data has 'c'" in text and "Prepare the eval data" in text


def test_a_column_of_another_type_is_blamed_on_the_data(tmp_path, model_def):
    train, _ = split(tmp_path, "t", "a,b,label", lambda i: f"{i / 20},{i % 3},{i % 2}")
    _, eval_ = split(tmp_path, "e", "a,b,label", lambda i: f"{i},{i % 3},{i % 2}")  # a: int64, not float64
    with pytest.raises(DataError, match=r"the result's '0' is float64 from the training data but int64 from the eval"):
        check_splits(model_def, train, eval_)


def test_an_unused_extra_column_is_only_logged(tmp_path, model_def, caplog):
    train, _ = split(tmp_path, "t", "a,b,label", lambda i: f"{i / 20},{i % 3},{i % 2}")
    _, eval_ = split(tmp_path, "e", "a,b,note,label", lambda i: f"{i / 20},{i % 3},x,{i % 2}")
    with caplog.at_level(logging.WARNING):
        check_splits(model_def, train, eval_)
    assert "only the eval data has 'note'" in caplog.text


def test_feed_failing_on_the_training_data_is_the_users_error_now(tmp_path, model_def):
    train, eval_ = split(tmp_path, "d", "a,c,label", lambda i: f"{i / 20},{i % 3},{i % 2}")
    with pytest.raises(ModelDefError) as e:
        check_splits(model_def, train, eval_)
    text = str(e.value)
    assert text.startswith("feed() in the model definition") and "raised KeyError while giving feed()" in text
    assert ": 'b'." in text
    assert "the first 8 records of the training data" in text and "before any worker started" in text
    assert f'{model_def.spec}", line' in text and "in feed" in text  # the user's own frame


def test_feed_failing_on_eval_values_with_the_same_columns_is_the_users_error(tmp_path):
    model_def = load(tmp_path, MODEL.replace("def feed(batch):", FUSSY_FEED))
    train, _ = split(tmp_path, "t", "a,b,label", lambda i: f"{i / 20},{i % 3},{i % 2}")
    _, eval_ = split(tmp_path, "e", "a,b,label", lambda i: f"{-i / 20 - 1},{i % 3},{i % 2}")
    with pytest.raises(
        ModelDefError,
        match=r"raised ValueError while giving feed\(\) the first 8 records of the eval data .*: a is negative",
    ):
        check_splits(model_def, train, eval_)


def test_model_that_raises_is_the_users_error_now(tmp_path):
    model_def = load(tmp_path, MODEL.replace("    return keras.Sequential", "    raise RuntimeError('no')\n    return"))
    train, eval_ = split(tmp_path, "d", "a,b,label", lambda i: f"{i / 20},{i % 3},{i % 2}")
    with pytest.raises(ModelDefError, match=r"model\(\) in the model definition .* raised RuntimeError while .*: no"):
        check_splits(model_def, train, eval_)


# ---------------------------------------------------------------- labels

# The same model with 3 classes and another loss: the instance, Keras's function, or a function of the user's.
LOSSES = {
    "instance": "loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)",
    "function": "loss = keras.losses.sparse_categorical_crossentropy",
    "wrapped": (
        "def loss(labels, predictions):\n"
        "    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True))"
    ),
}


def model_with(tmp_path, outputs: int, loss: str):
    text = MODEL.replace("Dense(2)", f"Dense({outputs})").replace(LOSSES["instance"], loss)
    return load(tmp_path, text)


def labelled(tmp_path, name: str, labels) -> tuple:
    """Train and eval data whose label of row i is labels(i)."""
    return split(tmp_path, name, "a,b,label", lambda i: f"{i / 20},{i % 3},{labels(i)}")


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_labels_past_the_models_classes_are_refused_naming_the_split(tmp_path, loss):
    model_def = model_with(tmp_path, 3, LOSSES[loss])
    train, eval_ = labelled(tmp_path, "d", lambda i: i % 5)
    with pytest.raises(DataError) as e:
        check_splits(model_def, train, eval_)
    text = str(e.value)
    assert text.startswith(f"The training data {train.uri} has labels 0 to 4 in column 'label'")
    assert "3 classes on its last axis" in text and "class indices 0 to 2" in text
    assert "Map the labels to 0 to 2 at the source, or give the model 5 outputs" in text


def test_negative_labels_are_refused(tmp_path):
    train, eval_ = labelled(tmp_path, "d", lambda i: i % 3 - 1)
    with pytest.raises(DataError, match=r"labels -1 to 1 .* Map the labels to 0 to 2 at the source\."):
        check_splits(model_with(tmp_path, 3, LOSSES["wrapped"]), train, eval_)


def test_eval_labels_outside_the_training_labels_are_refused(tmp_path):
    train, _ = labelled(tmp_path, "t", lambda i: i % 2)
    _, eval_ = labelled(tmp_path, "e", lambda i: 2)
    with pytest.raises(DataError) as e:
        check_splits(model_with(tmp_path, 3, LOSSES["instance"]), train, eval_)
    text = str(e.value)
    assert text.startswith(f"The eval data {eval_.uri} has only the label 2 in column 'label', outside the training")
    assert "labels 0 to 1 (2 distinct values)" in text and "one `elastic-step data prep`" in text


def test_labels_that_are_not_classes_are_not_checked(tmp_path, caplog):
    # A regression on an integer target: an eval value past the training range is only logged.
    mse = "loss = keras.losses.MeanSquaredError()"
    train, _ = labelled(tmp_path, "t", lambda i: i % 2)
    _, eval_ = labelled(tmp_path, "e", lambda i: i + 5)
    with caplog.at_level(logging.WARNING):
        check_splits(model_with(tmp_path, 1, mse), train, eval_)
        check_splits(model_with(tmp_path, 3, mse), train, eval_)
    assert "outside the training data's labels 0 to 1" in caplog.text


def test_labels_feed_changes_and_data_prepared_before_the_summary_are_not_checked(tmp_path):
    train, eval_ = labelled(tmp_path, "d", lambda i: i % 5 + 1)  # 1..5: feed() makes them 0..4
    shifted = MODEL.replace('batch["label"]', 'batch["label"] - 1').replace(LOSSES["instance"], LOSSES["function"])
    check_splits(load(tmp_path, shifted.replace("Dense(2)", "Dense(5)")), train, eval_)
    train.label_summary, eval_.label_summary = {}, {}  # as a manifest written before prep recorded it
    check_splits(model_with(tmp_path, 3, LOSSES["instance"]), train, eval_)
