"""The device a worker trains on: its first GPU when TensorFlow sees one, else the CPU, and why.

A GPU worker whose TensorFlow is the CPU build (the `tensorflow-cpu` wheel, an image without the `-gpu` suffix)
trains on its CPU while the GPU it holds sits idle; the worker says so in its log, and the master records each
launch's device in summary.json, so the cost is visible rather than silent.
"""

from __future__ import annotations


def training_device() -> str:
    """`GPU:0 (<name>)`, with how many more it sees, or `CPU (<why no GPU>)`."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        why = "no GPU visible" if tf.test.is_built_with_cuda() else "TensorFlow's CPU-only build"
        return f"CPU ({why})"
    name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "unnamed")
    more = f", {len(gpus) - 1} more GPU(s) unused" if len(gpus) > 1 else ""
    return f"GPU:0 ({name}{more})"
