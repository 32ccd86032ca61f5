"""The eval data checked against the training data before any instance starts, through the model's own feed().

Data prep writes both splits of one source with the same columns; data prepared apart (another source, another
day's export) may differ. Found here, such a difference is said as the data's, naming the columns, rather than
surfacing mid-training as an error of feed() or of the model on the first evaluation.
"""

from __future__ import annotations

import logging

import numpy as np

from elastic_step.data.api import Manifest, schema_differences
from elastic_step.data.reader import ShardReader
from elastic_step.errors import DataError, ModelDefError

log = logging.getLogger(__name__)

SAMPLE_RECORDS = 8  # records of each split given to feed()


def check_splits(model_def, train: Manifest, eval: Manifest | None) -> None:
    """Raise DataError when feed() cannot take the eval data as it takes the training data, or the two feed the
    model differently (structure, dtypes, shapes past the batch); log columns that differ otherwise. A feed()
    that fails on the training data too is left to the job, which reports it as the user's, once."""
    if eval is None:
        return
    differences = schema_differences(train, eval)
    try:
        fed = model_def.feed(_first_records(train))
    except ModelDefError:
        return  # the model's own error: the job meets and reports it as any error of the user's code
    where = f"the training data {train.uri} and the eval data {eval.uri}"
    columns = "; ".join(differences) if differences else "their columns match"
    try:
        fed_eval = model_def.feed(_first_records(eval))
    except ModelDefError as e:
        cause = e.__cause__ or e
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
