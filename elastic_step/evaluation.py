"""Evaluate a Keras model on a manifest's data with the model definition's feed, loss and metrics."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np

from elastic_step.data.manifest import Manifest
from elastic_step.data.reader import ShardReader


class EvalBatch(NamedTuple):
    """Records as the model takes them: features as tensors, labels, sample weights (or None), how many."""

    features: object
    labels: object
    weights: object
    records: int


def eval_batches(
    model_def, manifest: Manifest, batch_size: int = 1024, limit: int | None = None
) -> Iterator[EvalBatch]:
    """The manifest's records, read and fed a batch at a time (a batch never spans two shards); with `limit`,
    no batch starts once that many records are out. Lazy, so a whole eval set is never held at once; a
    caller that evaluates the same records again and again (the master's eval curve) keeps them in a list."""
    import tensorflow as tf

    count = 0
    for shard in manifest.shards:
        if limit is not None and count >= limit:
            return
        reader = ShardReader(manifest.shard_uri(shard))
        try:
            for lo in range(0, reader.num_rows, batch_size):
                if limit is not None and count >= limit:
                    return
                hi = min(reader.num_rows, lo + batch_size)
                features, labels, weights = model_def.examples(
                    reader.read(lo, hi), manifest.weight_column, training=False
                )
                # Tensors, as evaluate() makes them: a structure may mix numpy arrays and tensors (strings).
                yield EvalBatch(tf.nest.map_structure(tf.convert_to_tensor, features), labels, weights, hi - lo)
                count += hi - lo
        finally:
            reader.close()


def evaluate_batches(
    model, model_def, batches: Iterable[EvalBatch], metrics: dict | None = None, keep_predictions: bool = False
) -> dict:
    """evaluate() on batches already read. `metrics`: the model definition's eval metrics, to be used again
    (reset here) instead of made anew."""
    if metrics is None:
        metrics = model_def.eval_metrics()
    else:
        for m in metrics.values():
            m.reset_state()
    for tracker in model_def.compiled_loss(model).metrics:  # each output's loss, for a model of several
        tracker.reset_state()
    total_loss, count = 0.0, 0
    labels_all, preds_all = [], []
    for features, labels, weights, k in batches:
        try:
            preds = model(features, training=False)
            # What evaluate() reports: compute_loss() (the model's own, if it has one), regularization included.
            loss = float(model_def.compute_loss(model, features, labels, preds, weights, training=False))
            by_output = _by_output(model, labels), _by_output(model, preds)
            for m in metrics.values():
                m.update_state(*by_output)
        except Exception as e:
            raise model_def.user_error(e, "evaluating the model") from e
        total_loss += loss * k
        count += k
        if keep_predictions and not isinstance(preds, (dict, list, tuple)):
            labels_all.append(np.asarray(labels))
            preds_all.append(np.asarray(preds))
    result = {"loss": total_loss / count if count else float("nan"), "records": count}
    result.update(model_def.output_losses(model))
    result.update({name: float(m.result()) for name, m in metrics.items()})
    if keep_predictions:
        result["labels"] = np.concatenate(labels_all) if labels_all else np.array([])
        result["predictions"] = np.concatenate(preds_all) if preds_all else np.array([])
    return result


def _by_output(model, values):
    """A model's outputs (or their labels) given as a list, by output name, as its per-output metrics take them."""
    if isinstance(values, (list, tuple)) and len(values) == len(model.output_names) > 1:
        return dict(zip(model.output_names, values))
    return values


def evaluate(
    model,
    model_def,
    manifest: Manifest,
    batch_size: int = 1024,
    keep_predictions: bool = False,
    limit: int | None = None,
) -> dict:
    """Returns {"loss", <each eval metric>, "records"} and, if asked, labels and predictions.
    "loss" is what Keras's evaluate() reports: loss() reduced as compile reduces it, plus the
    model's regularization losses. The loss weighs records as evaluate() does with `sample_weight`:
    by feed()'s sample weights, or by the manifest's weight column; the metrics, as compile's
    `metrics`, do not (class_weight() is fit's only, as in Keras).
    `limit` stops after that many records (a quick point on a curve)."""
    # Closed at once, even when the model fails midway: its shard reader with it.
    with contextlib.closing(eval_batches(model_def, manifest, batch_size, limit)) as batches:
        return evaluate_batches(model, model_def, batches, keep_predictions=keep_predictions)
