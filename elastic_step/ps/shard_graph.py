"""A parameter-server shard's variables and its update graph, built from the model, the optimizer and the
placement alone: the shard's server (server.py) compiles the graph and serves it; a worker's copy of the shard
(worker/ps/step.py) traces its update inside the worker's own compiled call.

One call per push: split the flat gradient, apply the user's optimizer to the dense variables and the pushed
embedding rows, add the state's change, and read the fresh flat values back. Served, each is traced once into a
concrete function (any number of rows per table): for a small model, matching arguments against traces and a
second call for the read would cost as much as the update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from elastic_step.optimizers import moving_averages, updater
from elastic_step.ps.api import Placement, named_variables

# Optimizers whose update of an element depends only on that element's gradient and slots: on them
# a shard's dense variables can be one flat variable, updated by a handful of ops per push instead
# of a handful per variable (the same arithmetic, a fraction of the op dispatch).
ELEMENTWISE_OPTIMIZERS = frozenset({"SGD", "Adam", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Ftrl", "Lion"})


def updates_elementwise(optimizer) -> bool:
    """True for a stock Keras optimizer without per-variable options (weight decay can exclude
    variables by name). Clipping is the workers' (see elastic_step/optimizers.py)."""
    return (
        type(optimizer).__name__ in ELEMENTWISE_OPTIMIZERS
        and type(optimizer).__module__.startswith("keras.")
        and not getattr(optimizer, "weight_decay", None)
    )


@dataclass(frozen=True)
class ShardVariables:
    """What one shard holds: its dense weights (one flat variable, or one per weight), its rows of each embedding
    table, its share of the model's state (one flat variable), and the optimizer built on them."""

    dense_names: list  # the shard's dense weights, by stable name, in the order of its flat buffer
    dense_vars: list
    tables: dict  # table name -> the shard's rows of it (row r of the shard is row r * num_ps + shard of the table)
    state: object  # the flat state (BatchNormalization's moving statistics)
    optimizer: object
    layout: list  # every value a checkpoint of this shard holds, (name, shape, dtype), in order: a restore checks each
    weights_size: int
    dense_size: int  # the flat buffer: the weights, then the state


def shard_variables(model, optimizer, placement: Placement, shard: int) -> ShardVariables:
    """The shard's variables, at the model's values, and `optimizer` (which clips nothing: the workers clip) built
    on them."""
    import tensorflow as tf

    values = named_variables(model)
    dense_names = placement.weights_on(shard)
    state_names = placement.state_on(shard)
    if updates_elementwise(optimizer) and dense_names and all(values[n].dtype == "float32" for n in dense_names):
        flat = np.concatenate([values[n].numpy().astype(np.float32).ravel() for n in dense_names])
        dense_vars = [tf.Variable(flat, name="dense_flat")]
    else:
        # Named as the model's variables, so that weight decay excludes the ones a user names.
        dense_vars = [tf.Variable(values[n].numpy(), name=values[n].name) for n in dense_names]
    tables = {
        name: tf.Variable(values[name].numpy()[shard :: placement.num_ps], name=f"e{i}")
        for i, name in enumerate(placement.embeddings)
    }
    # The state (BatchNormalization's moving statistics) is no optimizer's: a push adds how the
    # worker's step changed it, so every step's update lands, as in one process.
    state = tf.Variable(
        np.concatenate([values[n].numpy().astype(np.float32).ravel() for n in state_names] + [np.zeros(0, np.float32)]),
        name="state_flat",
    )
    optimizer.build(dense_vars + list(tables.values()))
    layout = (
        [(values[n].path, tuple(values[n].shape), values[n].dtype) for n in dense_names + state_names]
        + [(f"{values[n].path} (its rows on shard {shard})", tuple(t.shape), t.dtype.name) for n, t in tables.items()]
        + [(v.path, tuple(v.shape), v.dtype) for v in optimizer.variables]
    )
    weights_size = sum(int(v.shape.num_elements()) for v in dense_vars)
    dense_size = weights_size + int(state.shape.num_elements())
    return ShardVariables(dense_names, dense_vars, tables, state, optimizer, layout, weights_size, dense_size)


@dataclass(frozen=True)
class ShardGraph:
    """The shard's calls as Python functions, to trace: compiled by `compile_graph` where the shard is served,
    traced inside a worker's call where it is a copy."""

    apply: Callable  # (flat gradient, each table's ids, each table's rows) -> the fresh flat values
    update: Callable  # (flat gradient) -> the fresh flat values: a shard without tables (the dense part only)
    apply_many: Callable  # (flat gradients [minibatches, floats]) -> the fresh flat values: their updates in turn
    values: Callable  # () -> the flat values
    words: Callable  # () -> the whole state as float32 words: the flat values, then each optimizer variable's bytes
    load_words: Callable  # (words) -> None: `words` back into the variables, in one call
    state_words: int  # how many `words` are; 0: not offered (a variable not float32 or not whole words)


def build_graph(v: ShardVariables, num_ps: int) -> ShardGraph:
    import tensorflow as tf

    dense_vars, state, tables = v.dense_vars, v.state, list(v.tables.values())
    weights_size, dense_size = v.weights_size, v.dense_size
    sizes = [int(d.shape.num_elements()) for d in dense_vars]
    update_variables = updater(v.optimizer, dense_vars + tables)

    def flat_values():
        return tf.concat([tf.reshape(tf.cast(d, tf.float32), [-1]) for d in dense_vars] + [state], 0)

    def apply(flat_grad, table_ids, table_values):
        flat_grad, state_change = tf.split(flat_grad, [weights_size, dense_size - weights_size])
        state.assign_add(state_change)
        grads = [
            tf.cast(tf.reshape(g, d.shape), d.dtype)
            for g, d in zip(tf.split(flat_grad, sizes) if sizes else [], dense_vars)
        ]
        for ids, rows, table in zip(table_ids, table_values, tables):
            grads.append(tf.IndexedSlices(rows, ids // num_ps, tf.shape(table, out_type=tf.int64)))
        update_variables(grads)
        return flat_values()

    def update(flat_grad):
        return apply(flat_grad, [], [])

    def apply_many(flat_grads):
        _, fresh = tf.while_loop(
            lambda k, _: k < tf.shape(flat_grads)[0],
            lambda k, _: (k + 1, update(flat_grads[k])),
            (tf.constant(0), flat_values()),
        )
        return fresh

    # A lone worker hands the shard its copy's words after a call instead of the shard running the same updates
    # again (ParameterShard.push_many); the iteration count rides bit for bit.
    opt_vars = list(v.optimizer.variables)
    opt_words = [int(o.shape.num_elements()) * np.dtype(o.dtype).itemsize // 4 for o in opt_vars]
    whole = all(np.dtype(o.dtype).itemsize % 4 == 0 for o in opt_vars) and all(
        d.dtype == tf.float32 for d in dense_vars
    )

    def words():
        parts = [flat_values()]
        for o in opt_vars:
            t = tf.convert_to_tensor(o)
            parts.append(tf.reshape(t if t.dtype == tf.float32 else tf.bitcast(t, tf.float32), [-1]))
        return tf.concat(parts, 0)

    def load_words(flat):
        # Assigning from numpy, variable by variable, would cost as much as the updates it spares.
        values, state_part, *opt_parts = tf.split(flat, [weights_size, dense_size - weights_size, *opt_words])
        for d, part in zip(dense_vars, tf.split(values, sizes) if sizes else []):
            d.assign(tf.reshape(part, d.shape))
        state.assign(state_part)
        for o, part in zip(opt_vars, opt_parts):
            dtype = tf.as_dtype(o.dtype)
            if dtype != tf.float32:
                part = tf.bitcast(tf.reshape(part, [-1, dtype.size // 4]), dtype)
            o.assign(tf.reshape(part, o.shape))

    state_words = dense_size + sum(opt_words) if whole else 0
    return ShardGraph(apply, update, apply_many, flat_values, words, load_words, state_words)


@dataclass(frozen=True)
class CompiledShard:
    """A served shard's calls, each a concrete function."""

    apply: Callable
    apply_many: Callable | None  # None for a shard with tables
    read: Callable  # () -> the flat values
    load_words: Callable | None  # None when the shard offers no words
    final: Callable | None  # () -> (flat values, table rows) the final model holds: with use_ema, the averages


def compile_graph(v: ShardVariables, graph: ShardGraph) -> CompiledShard:
    import tensorflow as tf

    tables = list(v.tables.values())
    apply = tf.function(graph.apply).get_concrete_function(
        tf.TensorSpec([v.dense_size], tf.float32),
        [tf.TensorSpec([None], tf.int64) for _ in tables],
        [tf.TensorSpec([None, *t.shape[1:]], t.dtype) for t in tables],
    )
    apply_many = None
    if not tables:
        apply_many = tf.function(graph.apply_many).get_concrete_function(
            tf.TensorSpec([None, v.dense_size], tf.float32)
        )
    read = tf.function(graph.values).get_concrete_function()
    load_words = None
    if graph.state_words:
        load_words = tf.function(graph.load_words).get_concrete_function(tf.TensorSpec([graph.state_words], tf.float32))
    final = None
    averages = moving_averages(v.optimizer, v.dense_vars + tables)
    if averages is not None:  # use_ema: the final model holds the averages, as after fit
        dense_averages, table_averages = averages[: len(v.dense_vars)], averages[len(v.dense_vars) :]

        def final_values():
            flat = tf.concat([tf.reshape(tf.cast(a, tf.float32), [-1]) for a in dense_averages] + [v.state], 0)
            return flat, table_averages

        final = tf.function(final_values).get_concrete_function()
    return CompiledShard(apply, apply_many, read, load_words, final)
