"""The eval data is checked against the training data through the model's feed(), before any instance starts."""

from __future__ import annotations

import logging

import pytest

from elastic_step.data.prep import prepare
from elastic_step.errors import DataError
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


@pytest.fixture
def model_def(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    return load_model_def(str(path))


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


def test_feed_failing_on_the_training_data_is_left_to_the_job(tmp_path, model_def):
    # The job reports it as the user's error, from whoever meets it first (tests/integration/test_errors.py).
    train, eval_ = split(tmp_path, "d", "a,c,label", lambda i: f"{i / 20},{i % 3},{i % 2}")
    check_splits(model_def, train, eval_)
