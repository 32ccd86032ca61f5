"""Saving and loading trained models: Keras `.keras` plus a SavedModel export, written atomically."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import fsspec

from elastic_step.errors import ModelDefError
from elastic_step.util.atomic import atomic_directory

KERAS_FILE = "model.keras"
SAVED_MODEL_DIR = "saved_model"


def save_model(model, output_dir: str) -> dict[str, str]:
    """Write OUTPUT/model.keras and OUTPUT/saved_model/, each appearing whole or not at all."""
    out = pathlib.Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp_keras = out / f".{KERAS_FILE}.{os.getpid()}.tmp.keras"  # keras insists on the suffix
    model.save(tmp_keras)
    os.replace(tmp_keras, out / KERAS_FILE)
    with atomic_directory(out / SAVED_MODEL_DIR) as tmp:
        model.export(str(tmp), format="tf_saved_model", verbose=False)
    return {"keras": str(out / KERAS_FILE), "saved_model": str(out / SAVED_MODEL_DIR)}


def load_model(uri: str, model_def=None):
    """Load `model.keras` from a file or a folder holding one (local or any fsspec URI)."""
    import keras

    fs, path = fsspec.core.url_to_fs(uri)
    if fs.isdir(path):
        path = path.rstrip("/") + "/" + KERAS_FILE
    if not fs.exists(path):
        raise ModelDefError(f"No trained model at {uri}: expected {KERAS_FILE} written by the training step.")
    local = path
    if fs.protocol not in ("file", ("file", "local")) and "file" not in fs.protocol:
        tmpdir = tempfile.mkdtemp(prefix="elastic-step-model-")
        local = os.path.join(tmpdir, KERAS_FILE)
        fs.get(path, local)
    try:
        return keras.models.load_model(local, compile=False)
    finally:
        if local != path:
            shutil.rmtree(os.path.dirname(local), ignore_errors=True)
