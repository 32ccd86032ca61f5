"""Parameter-server contract: where each parameter lives, and how a shard's dense part is laid out.

Dense variables go to a shard by a stable hash of their name; embedding rows by id
(`id mod num_ps`), so one table's rows spread over every shard. A shard's dense variables travel
as one flat buffer, in `variable_names` order. Workers, PS and master all derive the same
placement from the model itself, so nothing about it travels on the wire.
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from typing import NamedTuple

import numpy as np


def variable_names(model) -> list[str]:
    """Stable, unique names of a model's trainable variables: creation order + short name.

    Not the Keras path: its layer prefixes ("dense_3/") depend on how many layers the process
    built before, while every process builds the same model in the same order.
    """
    return [f"{i:04d}:{v.name}" for i, v in enumerate(model.trainable_variables)]


def embedding_variable_paths(model) -> set[str]:
    """Paths of the tables of plain `keras.layers.Embedding` layers: their rows are sharded by id."""
    import keras
    return {layer.embeddings.path for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, keras.layers.Embedding)}


@dataclasses.dataclass(frozen=True)
class Placement:
    num_ps: int
    dense: dict[str, int]                       # name -> shard
    shapes: dict[str, tuple[int, ...]]          # name -> shape (dense variables)
    embeddings: dict[str, tuple[int, int]]      # name -> (vocabulary rows, dim)

    @classmethod
    def of(cls, model, num_ps: int) -> "Placement":
        emb_paths = embedding_variable_paths(model)
        dense, shapes, emb = {}, {}, {}
        for name, v in zip(variable_names(model), model.trainable_variables):
            if v.path in emb_paths:
                emb[name] = (int(v.shape[0]), int(v.shape[1]))
            else:
                dense[name] = zlib.crc32(name.encode()) % num_ps
                shapes[name] = tuple(int(d) for d in v.shape)
        return cls(num_ps=num_ps, dense=dense, shapes=shapes, embeddings=emb)

    def dense_on(self, shard: int) -> list[str]:
        """The shard's dense variables, in the order of its flat buffer."""
        return [n for n, s in self.dense.items() if s == shard]

    def unflatten(self, shard: int, flat: np.ndarray) -> dict[str, np.ndarray]:
        out, offset = {}, 0
        for name in self.dense_on(shard):
            shape = self.shapes[name]
            size = math.prod(shape)
            out[name] = flat[offset:offset + size].reshape(shape)
            offset += size
        if offset != flat.size:
            raise ValueError(f"shard {shard} sent {flat.size} dense values, the model has {offset}")
        return out

    def split_ids(self, ids: np.ndarray) -> list[np.ndarray]:
        """Positions of `ids` owned by each shard (shard -> index array into ids)."""
        owner = ids % self.num_ps
        return [np.nonzero(owner == s)[0] for s in range(self.num_ps)]


class PushKey(NamedTuple):
    """One minibatch's push: its idempotency key (task_id, seq), under which a shard applies it at
    most once, and the records it is made of, which the shard accounts for as the audit's evidence."""
    task_id: int
    seq: int             # first record of the minibatch (an index into its data shard)
    end: int             # one past its last record
    epoch: int
    data_shard: int      # the data shard's index in the training manifest
    generation: int = 0  # the shards' state it was computed for (see PushRequest.generation)

    @classmethod
    def of(cls, request) -> "PushKey":
        """The key a PushRequest carries."""
        return cls(request.task_id, request.seq, request.end, request.epoch, request.data_shard, request.generation)

    @property
    def idempotency(self) -> tuple[int, int]:
        return self.task_id, self.seq

