"""Parameter-server contract: where each parameter lives, and how a shard's dense part is laid out.

Dense variables go to a shard by a stable hash of their name; embedding rows by id
(`id mod num_ps`), so one table's rows spread over every shard. A shard's dense part travels as
one flat buffer: its trainable variables in `variable_names` order, then its share of the model's
state (`state_variables`: BatchNormalization's moving statistics), whose "gradient" in a push is
how the step changed it. Workers, PS and master all derive the same placement from the model
itself, so nothing about it travels on the wire.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import NamedTuple

import numpy as np

# In a shard's saved state (ParameterShard.save) when its optimizer keeps moving averages (use_ema):
# the values a finished model holds, the flat dense values' layout, and each table's rows on the shard.
FINAL_DENSE = "final/dense"
FINAL_TABLE = "final/table/"


def variable_names(model) -> list[str]:
    """Stable, unique names of a model's trainable variables: creation order + short name.

    Not the Keras path: its layer prefixes ("dense_3/") depend on how many layers the process
    built before, while every process builds the same model in the same order.
    """
    return [f"{i:04d}:{v.name}" for i, v in enumerate(model.trainable_variables)]


def state_variables(model) -> list[tuple[str, int]]:
    """The state training changes without a gradient (BatchNormalization's moving mean and variance),
    as (stable name, position in model.non_trainable_variables): the floating-point non-trainable
    variables of layers that train. It lives on the PS like the weights, so the final model, the
    evaluation and the checkpoints hold it, and a worker that joins late starts from it. Left out:
    integer state (the seed of each worker's dropout masks stays its own) and frozen layers (nothing
    changes them: they would only travel as zeros)."""
    frozen = {id(v) for layer in model._flatten_layers(include_self=True) if not layer.trainable for v in layer.weights}
    return [
        (f"s{i:04d}:{v.name}", i)
        for i, v in enumerate(model.non_trainable_variables)
        if "float" in str(v.dtype) and id(v) not in frozen
    ]


def embedding_variable_paths(model) -> set[str]:
    """Paths of the tables of plain `keras.layers.Embedding` layers: their rows are sharded by id."""
    import keras

    return {
        layer.embeddings.path
        for layer in model._flatten_layers(include_self=False)
        if isinstance(layer, keras.layers.Embedding)
    }


@dataclasses.dataclass(frozen=True)
class Placement:
    num_ps: int
    dense: dict[str, int]  # name -> shard
    shapes: dict[str, tuple[int, ...]]  # name -> shape (dense variables)
    embeddings: dict[str, tuple[int, int]]  # name -> (vocabulary rows, dim)
    state: frozenset[str] = frozenset()  # the dense names that are state, not weights

    @classmethod
    def of(cls, model, num_ps: int) -> Placement:
        emb_paths = embedding_variable_paths(model)
        dense, shapes, emb = {}, {}, {}
        for name, v in zip(variable_names(model), model.trainable_variables):
            if v.path in emb_paths:
                emb[name] = (int(v.shape[0]), int(v.shape[1]))
            else:
                dense[name] = zlib.crc32(name.encode()) % num_ps
                shapes[name] = tuple(int(d) for d in v.shape)
        state = state_variables(model)
        for name, i in state:  # after every weight: a shard's flat buffer is its weights, then its state
            dense[name] = zlib.crc32(name.encode()) % num_ps
            shapes[name] = tuple(int(d) for d in model.non_trainable_variables[i].shape)
        return cls(
            num_ps=num_ps, dense=dense, shapes=shapes, embeddings=emb, state=frozenset(name for name, _ in state)
        )

    def dense_on(self, shard: int) -> list[str]:
        """The shard's dense variables, in the order of its flat buffer: weights, then state."""
        return [n for n, s in self.dense.items() if s == shard]

    def weights_on(self, shard: int) -> list[str]:
        return [n for n in self.dense_on(shard) if n not in self.state]

    def state_on(self, shard: int) -> list[str]:
        return [n for n in self.dense_on(shard) if n in self.state]

    def unflatten(self, shard: int, flat: np.ndarray) -> dict[str, np.ndarray]:
        out, offset = {}, 0
        for name in self.dense_on(shard):
            shape = self.shapes[name]
            size = math.prod(shape)
            out[name] = flat[offset : offset + size].reshape(shape)
            offset += size
        if offset != flat.size:
            raise ValueError(f"shard {shard} sent {flat.size} dense values, the model has {offset}")
        return out

    def split_ids(self, ids: np.ndarray) -> list[np.ndarray]:
        """Positions of `ids` owned by each shard (shard -> index array into ids)."""
        owner = ids % self.num_ps
        return [np.nonzero(owner == s)[0] for s in range(self.num_ps)]


def named_variables(model) -> dict:
    """Every variable the shards hold, by the name they hold it under: the weights, then the state."""
    named = dict(zip(variable_names(model), model.trainable_variables))
    state = model.non_trainable_variables
    named.update((name, state[i]) for name, i in state_variables(model))
    return named


def load_named(model, values: dict[str, np.ndarray]) -> None:
    """Set a model's weights and its PS-held state from values named as the shards name them."""
    for name, var in named_variables(model).items():
        var.assign(values[name])


class PushKey(NamedTuple):
    """One minibatch's push: its idempotency key (task_id, seq), under which a shard applies it at
    most once, and the records it is made of, which the shard accounts for as the audit's evidence."""

    task_id: int
    seq: int  # first record of the minibatch (an index into its data shard)
    end: int  # one past its last record
    epoch: int
    data_shard: int  # the data shard's index in the training manifest
    generation: int = 0  # the shards' state it was computed for (see PushRequest.generation)
    worker: int = -1  # who pushes: the worker's index and launch (see PushRequest.worker); a fenced launch's
    launch: int = 0  # pushes are refused
    # Loss scaling skipped this minibatch (its gradient overflowed at the worker's scale): the shard applies nothing
    # and accounts for its records as trained, as Keras's LossScaleOptimizer skips a step that consumed its batch.
    scale_skipped: bool = False

    @classmethod
    def of(cls, request) -> PushKey:
        """The key a PushRequest carries."""
        r = request
        return cls(r.task_id, r.seq, r.end, r.epoch, r.data_shard, r.generation, r.worker, r.launch, r.scale_skipped)

    @property
    def idempotency(self) -> tuple[int, int]:
        return self.task_id, self.seq


# Why a restore may not fit the model, and what to do: the job's checkpoints and members all hold one model.
CHANGED_MODEL = "the model changed since the job started (its code, or a file or parameter model() reads)"
CHANGED_MODEL_FIX = (
    "Start a new job (another --job-id, or --resume never to start this one over), or build the model as it was."
)


def layout_mismatch(here: list[tuple[str, tuple, str]], saved: list[tuple[tuple, str]], there: str) -> str | None:
    """The first variable whose shape or dtype differs between this model's variables, (name, shape, dtype), and a
    saved state's values, (shape, dtype), in the same order, in words (`there` names the saved state); else a
    difference in their numbers; None when they fit."""
    for (name, shape, dtype), (saved_shape, saved_dtype) in zip(here, saved):
        if tuple(shape) != tuple(saved_shape) or np.dtype(dtype) != np.dtype(saved_dtype):
            return (
                f"{name!r} is {tuple(shape)} {np.dtype(dtype).name} in this model, "
                f"{tuple(saved_shape)} {np.dtype(saved_dtype).name} in {there}"
            )
    if len(here) != len(saved):
        return f"this model has {len(here)} variables, {there} {len(saved)}"
    return None
