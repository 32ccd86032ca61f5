"""TensorBoard event files of a training job, written as it trains, so TensorBoard shows the run live.

Where: OUTPUT/tensorboard/, and also $AIP_TENSORBOARD_LOG_DIR when it is set. Vertex AI sets that
variable for a training job with a TensorBoard attached and streams whatever is written there into
it; a job is expected to write its event files straight into that folder.

What, with the step of every point being the records committed so far (so the training and the
evaluation curves share one axis; TensorBoard's "Relative" axis shows them over time instead):
- `train/loss`, `train/records_per_s`, `workers/alive`: each progress sample of the master (every
  0.5 s), the same figures as summary.json's `timeseries`;
- `eval/<metric>` (loss, accuracy, ...): the eval curve's points (master/curve.py: after epochs, as many as
  keep it within its share of training), each at the records committed when its epoch ended (0: the initial
  weights), as in `eval_history`; the last point is the final evaluation on the whole eval set (summary.json's
  `eval`).

Written with TensorFlow's own summary writer (`tf.summary.write` with the scalars plugin's metadata,
which is all `tf.summary.scalar` adds, and which needs no `tensorboard` package). A TensorBoard problem
never fails the job: it is logged once, and that folder gets no more points.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("elastic_step.master")

LOG_SUBDIR = "tensorboard"
VERTEX_LOG_DIR_ENV = "AIP_TENSORBOARD_LOG_DIR"
FLUSH_MILLIS = 2000  # live enough to watch, without a write to the (maybe remote) folder per point

TRAIN_LOSS, RECORDS_PER_S, WORKERS_ALIVE = "train/loss", "train/records_per_s", "workers/alive"
EVAL_PREFIX = "eval/"
DESCRIPTIONS = {
    TRAIN_LOSS: "Training loss: moving average of the workers' reported minibatch losses.",
    RECORDS_PER_S: "Records committed per second, over the last ~5 s.",
    WORKERS_ALIVE: "Workers registered and training.",
}
NOT_METRICS = ("t", "epoch", "records")  # keys of an eval point that are not metrics


def log_dirs(output: str, environ=None) -> list[str]:
    """The folders a job writes its event files to: OUTPUT/tensorboard, then Vertex AI's, if set."""
    environ = os.environ if environ is None else environ
    dirs = [os.path.join(output, LOG_SUBDIR)]
    vertex = environ.get(VERTEX_LOG_DIR_ENV, "").strip()
    if vertex and vertex not in dirs:
        dirs.append(vertex)
    return dirs


class TensorBoardLog:
    def __init__(self, dirs: list[str], records_per_epoch: int):
        self.dirs = list(dirs)
        self.records_per_epoch = records_per_epoch
        self._writers: dict[str, object] | None = None  # made at the first point: TensorFlow is loaded by then
        self._lock = threading.Lock()  # progress (master thread) and eval (evaluator thread)
        self._closed = False

    @classmethod
    def for_job(cls, output: str, records_per_epoch: int, environ=None) -> TensorBoardLog:
        return cls(log_dirs(output, environ), records_per_epoch)

    # ------------------------------------------------------------------ points
    def progress(self, sample: dict) -> None:
        """A progress sample of the master (coordinator.sample(): records, loss, records_per_s, workers_alive)."""
        scalars = {
            RECORDS_PER_S: sample.get("records_per_s"),
            WORKERS_ALIVE: sample.get("workers_alive"),
            TRAIN_LOSS: sample.get("loss"),
        }
        self._write(int(sample["records"]), scalars)

    def evaluation(self, point: dict) -> None:
        """An evaluation after epoch `point["epoch"]` (-1: the initial weights), with its metrics."""
        step = (int(point["epoch"]) + 1) * self.records_per_epoch
        self._write(step, {EVAL_PREFIX + k: v for k, v in point.items() if k not in NOT_METRICS})
        self.flush()  # an epoch's point is rare and worth seeing at once

    def flush(self) -> None:
        with self._lock:
            for d, w in list((self._writers or {}).items()):
                self._guard(d, w.flush)

    def close(self) -> None:
        with self._lock:
            for d, w in list((self._writers or {}).items()):
                self._guard(d, w.close)
            self._writers, self._closed = {}, True

    # ------------------------------------------------------------------ writing
    def _write(self, step: int, scalars: dict) -> None:
        scalars = {
            k: float(v)
            for k, v in scalars.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
        }  # no None, no NaN
        if not scalars:
            return
        with self._lock:
            if self._closed:
                return
            if self._writers is None:
                self._open()
            for d, w in list(self._writers.items()):
                self._guard(d, lambda w=w: self._write_scalars(w, step, scalars))

    @staticmethod
    def _write_scalars(writer, step: int, scalars: dict[str, float]) -> None:
        import tensorflow as tf

        with writer.as_default():
            for tag, value in scalars.items():
                tf.summary.write(tag, tf.constant(value, tf.float32), step=step, metadata=_scalar_metadata(tag))

    def _open(self) -> None:
        import tensorflow as tf

        self._writers = {}
        for d in self.dirs:
            try:
                self._writers[d] = tf.summary.create_file_writer(d, flush_millis=FLUSH_MILLIS)
            except Exception as e:  # noqa: BLE001 - no TensorBoard logs is not worth failing the job for
                log.warning(
                    "TensorBoard: cannot write event files to %s (%s); training goes on without them", d, _first_line(e)
                )

    def _guard(self, d: str, action) -> None:
        """Run a write, flush or close; on an error, log it and stop writing to that folder (lock held)."""
        try:
            action()
        except Exception as e:  # noqa: BLE001 - see _open
            log.warning(
                "TensorBoard: writing to %s failed (%s); no more points go there, training goes on", d, _first_line(e)
            )
            self._writers.pop(d, None)


def _scalar_metadata(tag: str):
    """What `tf.summary.scalar` attaches (TensorBoard's scalars plugin, version 0), plus a description."""
    from tensorflow.core.framework import summary_pb2

    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars", content=b""),
        summary_description=DESCRIPTIONS.get(tag, ""),
        data_class=summary_pb2.DATA_CLASS_SCALAR,
    )


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
