"""Click-through prediction: a wide-and-deep model over high-cardinality ids (elastic-step model contract).

Every id column gets plain `keras.layers.Embedding` layers: a 1-wide one for the wide (linear) part
and an EMBEDDING_DIM one for the deep part. In parameter-server mode elastic-step splits their rows
across PS shards by id hash, so the tables can grow far beyond one worker's memory.

    python samples/ctr/generate.py data/ctr.csv --rows 200000
    elastic-step data prep data/ctr.csv --label clicked --output data/ctr-prepared
    elastic-step train --model-def samples.ctr.model --prepared data/ctr-prepared --output out/ctr ...
"""

from __future__ import annotations

import keras
import numpy as np

# The vocabularies of samples/ctr/generate.py; ids must lie in [0, vocab).
ID_COLUMNS = {"user_id": 50_000, "ad_id": 20_000, "site_id": 5_000}
NUMERIC_COLUMNS = ["hour", "bid"]
LABEL = "clicked"
EMBEDDING_DIM = 8


def model() -> keras.Model:
    ids = {c: keras.Input(shape=(), dtype="int64", name=c) for c in ID_COLUMNS}
    numeric = {c: keras.Input(shape=(), dtype="float32", name=c) for c in NUMERIC_COLUMNS}

    # Wide: one learnt weight per id (a linear model on one-hot ids), summed.
    wide = keras.layers.Add(name="wide_logit")(
        [keras.layers.Embedding(vocab, 1, name=f"{c}_wide")(ids[c]) for c, vocab in ID_COLUMNS.items()]
    )

    # Deep: dense id embeddings and the numeric features through an MLP.
    deep = keras.layers.Concatenate(name="deep_input")(
        [keras.layers.Embedding(vocab, EMBEDDING_DIM, name=f"{c}_embedding")(ids[c]) for c, vocab in ID_COLUMNS.items()]
        + [keras.layers.Reshape((1,), name=f"{c}_column")(numeric[c]) for c in NUMERIC_COLUMNS]
    )
    deep = keras.layers.Dense(64, activation="relu", name="deep_1")(deep)
    deep = keras.layers.Dense(32, activation="relu", name="deep_2")(deep)
    deep = keras.layers.Dense(1, name="deep_logit")(deep)

    probability = keras.layers.Activation("sigmoid", name="click_probability")(
        keras.layers.Add(name="logit")([wide, deep])
    )
    return keras.Model({**ids, **numeric}, probability, name="ctr_wide_and_deep")


def loss(labels, predictions):
    # Flatten both, so [n] labels and [n, 1] predictions never broadcast to [n, n].
    labels = keras.ops.reshape(keras.ops.cast(labels, "float32"), (-1, 1))
    predictions = keras.ops.reshape(predictions, (-1, 1))
    return keras.ops.mean(keras.losses.binary_crossentropy(labels, predictions))


def optimizer() -> keras.optimizers.Optimizer:
    # Adagrad, as classic wide-and-deep: an id seen rarely keeps a large step, a frequent one settles.
    # Adam memorises the many rare ids of a small data set within two epochs (eval loss then rises).
    return keras.optimizers.Adagrad(learning_rate=0.2)


def feed(batch: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    features = {c: np.asarray(batch[c], dtype=np.int64) for c in ID_COLUMNS}
    # Scale numerics to about 0..1 here, so the data set keeps the raw values.
    features["hour"] = np.asarray(batch["hour"], dtype=np.float32) / 23.0
    features["bid"] = np.asarray(batch["bid"], dtype=np.float32) / 5.0
    labels = np.asarray(batch[LABEL], dtype=np.float32).reshape(-1, 1)  # the model's [n, 1] shape
    return features, labels


def eval_metrics() -> dict[str, keras.metrics.Metric]:
    return {"auc": keras.metrics.AUC(name="auc"), "accuracy": keras.metrics.BinaryAccuracy(name="accuracy")}
