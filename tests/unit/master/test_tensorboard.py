"""The training job's TensorBoard log (master/tensorboard.py): what it writes, read back with
TensorFlow's own event reader, where it writes, and that a problem never reaches the job."""

from __future__ import annotations

import logging

import pytest

from elastic_step.master.tensorboard import (
    EVAL_PREFIX,
    RECORDS_PER_S,
    TRAIN_LOSS,
    VERTEX_LOG_DIR_ENV,
    WORKERS_ALIVE,
    TensorBoardLog,
    log_dirs,
)
from tests.tensorboard_events import plugin_names, read_scalars

RECORDS_PER_EPOCH = 1000
SAMPLES = [  # as coordinator.sample() makes them
    {"t": 0.5, "epoch": 0, "records": 0, "records_per_s": 0.0, "loss": None, "workers_alive": 0},
    {"t": 1.0, "epoch": 0, "records": 0, "records_per_s": 0.0, "loss": None, "workers_alive": 2},
    {"t": 1.5, "epoch": 0, "records": 640, "records_per_s": 1280.0, "loss": 2.1, "workers_alive": 2},
    {"t": 2.0, "epoch": 1, "records": 1280, "records_per_s": 1280.0, "loss": 1.5, "workers_alive": 1},
    {"t": 2.5, "epoch": 1, "records": 1500, "records_per_s": 440.0, "loss": 1.2, "workers_alive": 2},
]
EVALS = [  # as eval_history holds them: epoch -1 is the initial weights
    {"t": 0.9, "epoch": -1, "loss": 2.31, "accuracy": 0.1},
    {"t": 2.1, "epoch": 0, "loss": 0.9, "accuracy": 0.71},
]


def write_run(log: TensorBoardLog) -> None:
    log.evaluation(EVALS[0])
    for s in SAMPLES:
        log.progress(s)
    log.evaluation(EVALS[1])
    log.evaluation({"epoch": 1, "loss": 0.4, "accuracy": 0.93, "records": 359})  # the final evaluation
    log.close()


def test_points_read_back_with_tensorflows_reader(tmp_path):
    write_run(TensorBoardLog.for_job(str(tmp_path), RECORDS_PER_EPOCH, environ={}))
    scalars = read_scalars(tmp_path / "tensorboard")
    assert set(scalars) == {TRAIN_LOSS, RECORDS_PER_S, WORKERS_ALIVE, EVAL_PREFIX + "loss", EVAL_PREFIX + "accuracy"}
    # progress: step = records committed; a sample without a loss yet has no loss point
    assert scalars[WORKERS_ALIVE] == [(s["records"], s["workers_alive"]) for s in SAMPLES]
    assert scalars[RECORDS_PER_S] == [(s["records"], s["records_per_s"]) for s in SAMPLES]
    assert scalars[TRAIN_LOSS] == [(s["records"], pytest.approx(s["loss"])) for s in SAMPLES if s["loss"] is not None]
    # eval: at the records committed when the epoch ended (0 for the initial weights); `records` is no metric
    assert scalars[EVAL_PREFIX + "accuracy"] == [
        (0, pytest.approx(0.1)),
        (1000, pytest.approx(0.71)),
        (2000, pytest.approx(0.93)),
    ]
    assert [step for step, _ in scalars[EVAL_PREFIX + "loss"]] == [0, 1000, 2000]
    # the scalars plugin's metadata is what makes TensorBoard draw them as charts
    assert set(plugin_names(tmp_path / "tensorboard").values()) == {"scalars"}


def test_vertex_ai_log_dir_is_honoured(tmp_path):
    vertex = tmp_path / "vertex" / "logs"
    assert log_dirs(str(tmp_path / "out"), environ={VERTEX_LOG_DIR_ENV: str(vertex)}) == [
        str(tmp_path / "out" / "tensorboard"),
        str(vertex),
    ]
    assert log_dirs(str(tmp_path / "out"), environ={VERTEX_LOG_DIR_ENV: "  "}) == [
        str(tmp_path / "out" / "tensorboard")
    ]
    write_run(
        TensorBoardLog.for_job(str(tmp_path / "out"), RECORDS_PER_EPOCH, environ={VERTEX_LOG_DIR_ENV: str(vertex)})
    )
    # Vertex AI streams what is written straight into its folder: the same points go there
    assert read_scalars(vertex) == read_scalars(tmp_path / "out" / "tensorboard")


def test_a_folder_that_cannot_be_written_is_logged_and_the_others_still_get_points(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    log = TensorBoardLog([str(blocker / "tensorboard"), str(tmp_path / "ok")], RECORDS_PER_EPOCH)
    with caplog.at_level(logging.WARNING, logger="elastic_step.master"):
        write_run(log)  # no exception: a TensorBoard problem never fails the job
    assert any("TensorBoard" in r.getMessage() and str(blocker) in r.getMessage() for r in caplog.records)
    assert read_scalars(tmp_path / "ok")[WORKERS_ALIVE] == [(s["records"], s["workers_alive"]) for s in SAMPLES]


def test_points_after_close_are_dropped_quietly(tmp_path):
    log = TensorBoardLog.for_job(str(tmp_path), RECORDS_PER_EPOCH, environ={})
    log.progress(SAMPLES[2])
    log.close()
    log.progress(SAMPLES[3])  # a late sample from the master's loop: nothing, and no error
    log.close()
    assert read_scalars(tmp_path / "tensorboard")[WORKERS_ALIVE] == [(640, 2)]
