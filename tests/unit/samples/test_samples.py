"""The sample model modules train with plain Keras, through their own feed(), unchanged."""

from __future__ import annotations

import csv
import math
import pathlib

import numpy as np
import pyarrow.csv as pa_csv
import pytest

keras = pytest.importorskip("keras")

from elastic_step.model_def import load_model_def  # noqa: E402
from samples.ctr import generate as ctr_generate  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[3]


def read_columns(path) -> dict[str, np.ndarray]:
    table = pa_csv.read_csv(str(path))
    return {c: table.column(c).to_numpy() for c in table.column_names}


def take(batch, rows):
    return {k: v[rows] for k, v in batch.items()}


def compiled(model_def):
    net = model_def.model()
    net.compile(
        optimizer=model_def.optimizer(), loss=model_def.loss_fn, metrics=list(model_def.eval_metrics().values())
    )
    return net


# digits.csv as samples/digits/make_csv.py wrote it from scikit-learn 1.9.1's load_digits(). The project no longer
# installs scikit-learn (Keras imports it in every TensorFlow process when it is there), so the file is pinned.
DIGITS_SHA256 = "4faf08295f17d77e9a147ed5ea842ec501bd089cc6e61627f36ef15c1b48ea5b"


def digits() -> tuple[np.ndarray, np.ndarray]:
    """(pixels (1797, 64), labels (1797,)) of the shipped digits.csv."""
    batch = read_columns(ROOT / "samples/digits/digits.csv")
    return np.stack([batch[f"pixel_{i}"] for i in range(64)], axis=1), batch["label"]


def test_digits_csv_is_the_uci_digits_as_make_csv_wrote_them():
    import hashlib

    data = (ROOT / "samples/digits/digits.csv").read_bytes()
    assert hashlib.sha256(data).hexdigest() == DIGITS_SHA256, "digits.csv changed: regenerate it with make_csv.py"
    pixels, labels = digits()
    assert pixels.shape == (1797, 64) and pixels.min() == 0 and pixels.max() == 16
    assert sorted(np.bincount(labels)) == [174, 177, 178, 179, 180, 181, 181, 182, 182, 183]


def test_augmented_digits_keep_every_original_and_its_label():
    from samples.digits.make_csv import augmented

    pixels, labels = digits()
    x, y = augmented(3, seed=0)
    assert x.shape == (3 * 1797, 64) and x.min() >= 0 and x.max() <= 16
    assert np.array_equal(np.bincount(y), 3 * np.bincount(labels))
    originals = {row.tobytes(): label for row, label in zip(pixels.astype(np.int64), labels)}
    seen = [
        originals[row.tobytes()] == label for row, label in zip(x.astype(np.int64), y) if row.tobytes() in originals
    ]
    assert len(seen) >= 1797 and all(seen)  # every original as it is (a variant may equal one, too)


def test_digits_trains_with_plain_keras():
    keras.utils.set_random_seed(0)
    md = load_model_def("samples.digits.model")
    batch = read_columns(ROOT / "samples/digits/digits.csv")
    assert len(batch) == 65 and len(batch["label"]) == 1797
    order = np.random.default_rng(0).permutation(1797)
    train, held_out = order[:1437], order[1437:]

    x, y = md.feed(take(batch, train))
    assert x.dtype == np.float32 and x.shape == (1437, 64) and 0 <= x.min() and x.max() <= 1
    assert y.dtype in (np.int32, np.int64) and y.shape == (1437,)
    net = compiled(md)
    net.fit(x, y, epochs=8, batch_size=64, verbose=0)

    x, y = md.feed(take(batch, held_out))
    metrics = dict(md.eval_metrics())
    metrics["accuracy"].update_state(y, net.predict(x, verbose=0))
    assert float(metrics["accuracy"].result()) >= 0.9


def test_ctr_generate_is_seeded_and_learnable(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    ctr_generate.generate(str(a), rows=500, seed=3)
    ctr_generate.main([str(b), "--rows", "500", "--seed", "3"])
    assert a.read_bytes() == b.read_bytes()
    with open(a) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ctr_generate.COLUMNS and len(rows) == 500
    for column, vocab in ctr_generate.ID_COLUMNS.items():
        assert all(0 <= int(r[column]) < vocab for r in rows)
    assert {r["clicked"] for r in rows} == {"0", "1"}


def test_ctr_loss_falls_with_plain_keras(tmp_path):
    keras.utils.set_random_seed(0)
    path = tmp_path / "ctr.csv"
    ctr_generate.generate(str(path), rows=20_000, seed=0)
    md = load_model_def("samples.ctr.model")
    batch = read_columns(path)
    features, labels = md.feed(take(batch, slice(0, 16_000)))
    assert set(features) == {i.name for i in md.model().inputs}
    assert labels.dtype == np.float32

    # Only plain keras.layers.Embedding holds per-id rows: parameter servers shard exactly those.
    net = compiled(md)
    embeddings = [layer for layer in net.layers if isinstance(layer, keras.layers.Embedding)]
    assert {type(layer) for layer in embeddings} == {keras.layers.Embedding} and len(embeddings) == 6
    assert sorted(layer.input_dim for layer in embeddings) == sorted(list(ctr_generate.ID_COLUMNS.values()) * 2)

    history = net.fit(features, labels, epochs=2, batch_size=128, verbose=0).history["loss"]
    rate = float(labels.mean())
    base_rate_loss = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert history[1] < history[0] - 0.01 and history[1] < base_rate_loss - 0.03, (history, base_rate_loss)

    x, y = md.feed(take(batch, slice(16_000, None)))
    auc = md.eval_metrics()["auc"]
    auc.update_state(y, net.predict(x, verbose=0, batch_size=1024))
    assert float(auc.result()) > 0.62


def test_the_adapted_ctr_sample_trains_with_plain_fit_on_the_statistics_of_its_manifest(ctr_data):
    import elastic_step.data
    from elastic_step.data.reader import read_all

    module = load_model_def(str(ROOT / "samples/ctr/adapted.py")).module
    net = module.model(elastic_step.data.statistics(ctr_data["train"]))
    net.compile(optimizer=module.optimizer(), loss=module.loss, metrics=list(module.eval_metrics().values()))
    keras.utils.set_random_seed(0)
    net.fit(*module.feed(read_all(ctr_data["train"])), epochs=1, batch_size=64, verbose=0)
    result = net.evaluate(*module.feed(read_all(ctr_data["eval"])), verbose=0, return_dict=True)
    assert result["auc"] > 0.6, result
