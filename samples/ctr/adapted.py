"""Click-through prediction with preprocessing layers built from the data's statistics, in the style of Keras's
structured-data guide: each numeric column through `Normalization` with its mean and variance, each id column
through `IntegerLookup` (a string column would take `StringLookup`) with its vocabulary, then an embedding.

model() takes one argument, the statistics `elastic-step data prep` recorded for the training data: elastic-step
passes them. Under plain Keras, read them from the manifest:

    import elastic_step.data
    net = model(elastic_step.data.statistics("data/ctr-prepared/train"))

    elastic-step train --model-def samples/ctr/adapted.py --prepared data/ctr-prepared --output out/ctr-adapted ...
"""

from __future__ import annotations

import keras
import numpy as np

ID_COLUMNS = ["user_id", "ad_id", "site_id"]
NUMERIC_COLUMNS = ["hour", "bid"]
LABEL = "clicked"
EMBEDDING_DIM = 8


def model(statistics: dict) -> keras.Model:
    ids = {c: keras.Input(shape=(), dtype="int64", name=c) for c in ID_COLUMNS}
    numeric = {c: keras.Input(shape=(), dtype="float32", name=c) for c in NUMERIC_COLUMNS}
    features = []
    for c in NUMERIC_COLUMNS:
        s = statistics[c]
        column = keras.layers.Reshape((1,), name=f"{c}_column")(numeric[c])
        features.append(keras.layers.Normalization(mean=s["mean"], variance=s["variance"], name=f"{c}_norm")(column))
    for c in ID_COLUMNS:
        # The vocabulary prep kept (its most frequent ids, up to its cap); any other id is out of vocabulary.
        lookup = keras.layers.IntegerLookup(vocabulary=statistics[c]["vocabulary"], name=f"{c}_lookup")
        embedded = keras.layers.Embedding(lookup.vocabulary_size(), EMBEDDING_DIM, name=f"{c}_embedding")(
            lookup(ids[c])
        )
        features.append(embedded)
    x = keras.layers.Concatenate(name="features")(features)
    x = keras.layers.Dense(32, activation="relu", name="hidden")(x)
    probability = keras.layers.Dense(1, activation="sigmoid", name="click_probability")(x)
    return keras.Model({**ids, **numeric}, probability, name="ctr_adapted")


loss = keras.losses.BinaryCrossentropy()


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adagrad(learning_rate=0.2)


def feed(batch: dict[str, np.ndarray]):
    features = {c: batch[c].astype("int64") for c in ID_COLUMNS}
    features.update({c: batch[c].astype("float32") for c in NUMERIC_COLUMNS})
    return features, batch[LABEL].astype("float32")[:, None]


def eval_metrics() -> dict[str, keras.metrics.Metric]:
    return {"auc": keras.metrics.AUC(name="auc"), "accuracy": keras.metrics.BinaryAccuracy(name="accuracy")}
