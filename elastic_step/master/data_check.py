"""The data checked against the model and the eval data against the training data, before any instance starts.

Data prep writes both splits of one source with the same columns; data prepared apart (another source, another
day's export) may differ. Found here, such a difference is said as the data's, naming the columns, rather than
surfacing mid-training as an error of feed() or of the model on the first evaluation. So are labels the model
cannot take (a class index past the model's classes), which TensorFlow would refuse deep inside a training step,
and eval labels outside the training data's classes. An error of feed() on the first records is the user's, said
once, now.
"""

from __future__ import annotations

import logging

import numpy as np

from elastic_step.data.manifest import Manifest, schema_differences
from elastic_step.data.reader import ShardReader
from elastic_step.errors import DataError, ModelDefError

log = logging.getLogger(__name__)

SAMPLE_RECORDS = 8  # records of each split given to feed()
INTEGRAL = ("int64", "bool")  # label types whose values are classes when the loss takes class indices


def check_splits(model_def, train: Manifest, eval: Manifest | None) -> None:
    """Raise ModelDefError (the user's) when model() fails or overrides a step elastic-step runs, or feed() fails
    on the training data's first records; DataError when feed() cannot take the eval data as it takes the
    training data, or the two feed the model differently (structure, dtypes, shapes past the batch), or a split's
    labels are outside what the model takes or the eval labels outside the training data's classes. Columns
    that differ otherwise are logged."""
    # A model() that raises, or a model overriding a method elastic-step runs itself: the user's error, now.
    model = model_def.model()
    records = _first_records(train)
    fed = _feed(model_def, records, f"the first {SAMPLE_RECORDS} records of the training data {train.uri}")
    if eval is not None:
        _check_eval_feed(model_def, train, eval, fed)
    _check_labels(model_def, model, train, eval, records, fed)


def _feed(model_def, records: dict, what: str):
    """feed(records); its error told as the user's, saying which records it was given."""
    try:
        return model_def.feed(records)
    except ModelDefError as e:
        raise _users(model_def, e, what) from None


def _users(model_def, error: ModelDefError, what: str) -> ModelDefError:
    if error.__cause__ is None:  # not raised by the user's code: ours, about its result
        return error
    return model_def.user_error(error.__cause__, f"giving feed() {what}, before any worker started", "feed")


def _check_eval_feed(model_def, train: Manifest, eval: Manifest, fed) -> None:
    differences = schema_differences(train, eval)
    where = f"the training data {train.uri} and the eval data {eval.uri}"
    columns = "; ".join(differences) if differences else "their columns match"
    records = _first_records(eval)
    try:
        fed_eval = model_def.feed(records)
    except ModelDefError as e:
        cause = e.__cause__ or e
        if not differences:  # the same columns: the user's feed() on these values
            raise _users(model_def, e, f"the first {SAMPLE_RECORDS} records of the eval data {eval.uri}") from None
        raise DataError(
            f"feed() takes the training data's records but not the eval data's: it raised "
            f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''} on {eval.uri}. The columns "
            f"of {where} differ: {columns}. Prepare the eval data with the training data's columns "
            "(the same source format and schema; `elastic-step data prep` writes both from one source)."
        ) from None
    mismatch = _fed_differently(fed, fed_eval)
    if mismatch:
        raise DataError(
            f"feed() gives the model different inputs from {where}: {mismatch}. Their columns: {columns}. Prepare "
            "the eval data with the training data's columns and types (e.g. pass the same --schema to both preps)."
        )
    if differences:
        log.warning("the eval data's columns differ from the training data's (%s); feed() takes both", columns)


def _check_labels(model_def, model, train: Manifest, eval: Manifest | None, records: dict, fed) -> None:
    """Each split's label range (from its manifest, written by prep) against the classes the model's output
    has when loss() takes class indices, and the eval labels against the training labels. Skipped for data
    prepared before prep recorded the range, and when feed() changes the labels (their range is then unknown)."""
    splits = [(name, m) for name, m in (("training", train), ("eval", eval)) if m is not None and m.label_summary]
    if not splits or train.label is None:
        return
    classes = _class_count(model_def, model, fed) if _passes_labels(records.get(train.label), fed) else None
    if classes is not None:
        for name, m in splits:
            low, high = m.label_summary["min"], m.label_summary["max"]
            if low < 0 or high >= classes:
                more = f", or give the model {int(high) + 1} outputs on its last axis" if low >= 0 else ""
                raise DataError(
                    f"The {name} data {m.uri} has {_labels(m.label_summary)} in column "
                    f"{m.label!r}, but the model's output has {classes} classes on its last axis and loss() takes "
                    f"class indices 0 to {classes - 1}: TensorFlow would stop training on the first label outside "
                    f"them. Map the labels to 0 to {classes - 1} at the source{more}."
                )
    t, e = train.label_summary, eval.label_summary if eval is not None else {}
    if not e or t.get("type") not in INTEGRAL or e.get("type") not in INTEGRAL:
        return
    if e["min"] >= t["min"] and e["max"] <= t["max"]:
        return
    text = (
        f"The eval data {eval.uri} has {_labels(e)} in column {eval.label!r}, outside the training data's "
        f"{_labels(t)}" + (f" ({t['distinct']} distinct values)" if "distinct" in t else "") + f" ({train.uri})"
    )
    if classes is None:  # not known to be classes (a count, an integer target): said, not refused
        log.warning("%s", text)
        return
    raise DataError(
        f"{text}: the model would be scored on classes it never trained on. Prepare train and eval from one "
        "source with one `elastic-step data prep` (it splits them), or check that both use the same label encoding."
    )


def _passes_labels(raw, fed) -> bool:
    """Whether feed() gave the label column's values as the labels, unchanged (up to dtype and a trailing axis)."""
    if raw is None or not isinstance(fed, (tuple, list)) or len(fed) not in (2, 3):
        return False
    try:
        y = np.asarray(fed[1])
        return y.size == len(raw) and bool(np.array_equal(y.reshape(-1).astype(np.float64), raw.astype(np.float64)))
    except (TypeError, ValueError):
        return False


def _class_count(model_def, model, fed) -> int | None:
    """K when loss() takes class indices 0..K-1 over the last axis of the model's output (sparse categorical
    cross-entropy), else None. The model is called on the sampled records; a loss that is not
    Keras's own is tried with the labels K-1 and K (taking the first and not the second is that loss)."""
    import keras

    x, y = fed[0], np.asarray(fed[1])
    try:
        predictions = model(x, training=False)
    except Exception as e:  # noqa: BLE001 - met again in a training step, where it is reported as the user's
        log.debug("label check skipped: the model does not take feed()'s result outside a training step: %s", e)
        return None
    shape = getattr(predictions, "shape", None)
    if shape is None or len(shape) < 2 or shape[-1] is None or int(shape[-1]) < 2:
        return None
    k, loss = int(shape[-1]), model_def.module.loss
    if (
        isinstance(loss, keras.losses.SparseCategoricalCrossentropy)
        or loss is keras.losses.sparse_categorical_crossentropy
    ):
        return k

    def takes(label: int) -> bool:
        try:
            value = model_def.loss_fn(np.full_like(y, label), predictions)
            return bool(np.isfinite(np.asarray(value)).all())
        except Exception:  # noqa: BLE001 - a loss that cannot take this label
            return False

    return k if takes(k - 1) and not takes(k) else None


def _labels(summary: dict) -> str:
    """A split's label range for a person: "labels 0 to 9", "only the label 2"."""
    low, high = (
        str(int(v)) if isinstance(v, bool) or float(v).is_integer() else str(v)
        for v in (summary["min"], summary["max"])
    )
    return f"only the label {low}" if low == high else f"labels {low} to {high}"


def _first_records(manifest: Manifest) -> dict[str, np.ndarray]:
    shard = next((s for s in manifest.shards if s.rows), None)
    if shard is None:
        raise DataError(f"The data {manifest.uri} has no records. Re-run `elastic-step data prep` on its source.")
    reader = ShardReader(manifest.shard_uri(shard))
    try:
        return reader.read(0, min(SAMPLE_RECORDS, reader.num_rows))
    finally:
        reader.close()


def _fed_differently(a, b) -> str:
    """What differs between two results of feed(), as a phrase ("" when nothing does)."""
    import keras

    try:
        keras.tree.assert_same_structure(a, b)
    except (ValueError, TypeError):
        outline = lambda v: str(keras.tree.map_structure(lambda _: "·", v))  # noqa: E731
        return f"a result shaped {outline(a)} from the training data but {outline(b)} from the eval data"
    for (path, x), y in zip(keras.tree.flatten_with_path(a), keras.tree.flatten(b)):
        x, y = np.asarray(x), np.asarray(y)
        name = f"the result's {'/'.join(map(str, path))!r}" if path else "the result"
        if x.dtype != y.dtype:
            return f"{name} is {x.dtype} from the training data but {y.dtype} from the eval data"
        if x.shape[1:] != y.shape[1:]:
            return f"{name} has rows of shape {x.shape[1:]} from the training data but {y.shape[1:]} from the eval data"
    return ""
