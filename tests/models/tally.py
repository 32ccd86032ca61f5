"""A model whose trained weights count how often each record was applied: the end-to-end witness
of exactly-once, which owes nothing to the master's ledger or to the PS shards' accounting.

Every record carries its own id. Its prediction is the sum of two weights of its own: a row of an
Embedding table (in `ps` mode sharded over the parameter servers by id) and an element of a Dense
kernel over the id's one-hot (a dense variable, placed whole on one shard). The loss is minus the
mean prediction, so a record's two weights get a negative gradient in every update that holds it,
and no other weight does. The optimizer is sign descent: each update adds exactly 1.0 to the
weights of every record it holds, whatever the minibatch size, the number of workers or the
averaging (one update per push in `ps` mode, per committed step in `allreduce`, where
`--global-batch fixed` keeps the learning rate at 1). After training, each weight is the number of
times its record was applied: `epochs` for a train record, 0 for an eval record. (One blind spot:
a record held twice by one allreduce step would count once. Nothing else is.)

With TALLY_TABLE=0 the model has the Dense kernel alone: no table, so in `ps` mode a worker runs
several minibatches a call on its copies of the shards (worker/ps/trainer.py).
"""

from __future__ import annotations

import os

import keras
import numpy as np

RECORDS = 3000  # ids 0..RECORDS-1: the generated data set (see write_csv)
# Tallies per record: 1. A test of a model changed through a setting model() reads (this file unchanged) sets more.
UNITS_ENV = "TALLY_UNITS"
TABLE_ENV = "TALLY_TABLE"  # "0": no Embedding table, the Dense kernel alone


def with_table() -> bool:
    return os.environ.get(TABLE_ENV, "1") != "0"


def model() -> keras.Model:
    units = int(os.environ.get(UNITS_ENV, "1"))
    onehot = keras.Input(shape=(RECORDS,), dtype="float32", name="onehot")
    if not with_table():
        dense = keras.layers.Dense(units, use_bias=False, kernel_initializer="zeros", name="tally_dense")(onehot)
        return keras.Model({"onehot": onehot}, dense, name="tally")
    ids = keras.Input(shape=(1,), dtype="int64", name="id")
    row = keras.layers.Flatten()(
        keras.layers.Embedding(RECORDS, units, embeddings_initializer="zeros", name="tally_rows")(ids)
    )
    dense = keras.layers.Dense(units, use_bias=False, kernel_initializer="zeros", name="tally_dense")(onehot)
    return keras.Model({"id": ids, "onehot": onehot}, keras.layers.Add()([row, dense]), name="tally")


def loss(labels, predictions):
    return -keras.ops.mean(predictions)


class SignDescent(keras.optimizers.Optimizer):
    """w -= lr * sign(g): every weight with a gradient moves by exactly lr, whatever its scale."""

    def update_step(self, gradient, variable, learning_rate):
        gradient = keras.ops.convert_to_tensor(gradient)  # a table's rows may come as IndexedSlices
        self.assign_sub(variable, keras.ops.cast(learning_rate, variable.dtype) * keras.ops.sign(gradient))


def optimizer() -> keras.optimizers.Optimizer:
    return SignDescent(learning_rate=1.0)


def feed(batch: dict[str, np.ndarray]):
    ids = np.asarray(batch["id"], dtype=np.int64)
    onehot = np.zeros((len(ids), RECORDS), np.float32)
    onehot[np.arange(len(ids)), ids] = 1.0
    features = {"id": ids[:, None], "onehot": onehot} if with_table() else {"onehot": onehot}
    return features, np.zeros(len(ids), np.float32)


def write_csv(path: str) -> None:
    ids = np.arange(RECORDS)
    np.savetxt(path, np.stack([ids, ids % 2], axis=1), fmt="%d", delimiter=",", header="id,label", comments="")


def tallies(model_path: str) -> tuple[np.ndarray | None, np.ndarray]:
    """(embedding row weights, or None without a table; dense kernel weights), one per record id, from a
    saved model."""
    m = keras.saving.load_model(model_path, compile=False)
    rows = m.get_layer("tally_rows").get_weights()[0][:, 0] if any(l.name == "tally_rows" for l in m.layers) else None
    return rows, m.get_layer("tally_dense").get_weights()[0][:, 0]
