"""Reading TensorBoard event files back with TensorFlow's own reader, for the tests."""

from __future__ import annotations

import pathlib


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] in the order written, from every event file under `log_dir`
    (tf.compat.v1.train.summary_iterator: the reader TensorBoard's own loaders build on)."""
    import tensorflow as tf

    files = sorted(pathlib.Path(log_dir).rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event files under {log_dir}"
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in files:
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                assert value.metadata.plugin_data.plugin_name in ("scalars", ""), value.tag
                number = float(tf.make_ndarray(value.tensor)) if value.HasField("tensor") else value.simple_value
                scalars.setdefault(value.tag, []).append((event.step, number))
    return scalars


def plugin_names(log_dir) -> dict[str, str]:
    """tag -> the plugin its metadata names (what makes TensorBoard draw it as a scalar chart)."""
    import tensorflow as tf

    names: dict[str, str] = {}
    for path in sorted(pathlib.Path(log_dir).rglob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name:
                    names.setdefault(value.tag, value.metadata.plugin_data.plugin_name)
    return names
