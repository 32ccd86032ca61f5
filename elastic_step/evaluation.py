"""Evaluate a Keras model on a manifest's data with the model definition's feed, loss and metrics."""

from __future__ import annotations

import numpy as np

from elastic_step.data.api import Manifest
from elastic_step.data.reader import ShardReader


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
    import tensorflow as tf

    metrics = model_def.eval_metrics()
    total_loss, count = 0.0, 0
    labels_all, preds_all = [], []
    for shard in manifest.shards:
        if limit is not None and count >= limit:
            break
        reader = ShardReader(manifest.shard_uri(shard))
        try:
            for lo in range(0, reader.num_rows, batch_size):
                if limit is not None and count >= limit:
                    break
                hi = min(reader.num_rows, lo + batch_size)
                batch = reader.read(lo, hi)
                features, labels, weights = model_def.examples(batch, manifest.weight_column, training=False)
                # Tensors, as evaluate() makes them: a structure may mix numpy arrays and tensors (strings).
                features = tf.nest.map_structure(tf.convert_to_tensor, features)
                try:
                    preds = model(features, training=False)
                    loss = float(model_def.loss_fn(labels, preds, weights))
                    # The model's own losses (regularizers), as Keras's evaluate() reports them too.
                    loss += sum(float(extra) for extra in model.losses)
                    for m in metrics.values():
                        m.update_state(labels, preds)
                except Exception as e:
                    raise model_def.user_error(e, "evaluating the model") from e
                k = hi - lo
                total_loss += loss * k
                count += k
                if keep_predictions:
                    labels_all.append(np.asarray(labels))
                    preds_all.append(np.asarray(preds))
        finally:
            reader.close()
    result = {"loss": total_loss / count if count else float("nan"), "records": count}
    result.update({name: float(m.result()) for name, m in metrics.items()})
    if keep_predictions:
        result["labels"] = np.concatenate(labels_all) if labels_all else np.array([])
        result["predictions"] = np.concatenate(preds_all) if preds_all else np.array([])
    return result
