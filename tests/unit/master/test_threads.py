"""The TensorFlow pools the master gives each instance (master/threads.py), and worker_threads from each surface to
the job's config."""

from __future__ import annotations

import pytest

from elastic_step import spec
from elastic_step.cli import build_parser
from elastic_step.errors import ConfigError
from elastic_step.master.api import TrainConfig
from elastic_step.master.threads import (
    HEAVY_MINIBATCH,
    INTER_OP_ENV,
    INTRA_OP_ENV,
    cpu_cores,
    multiply_adds,
    pools_env,
    worker_inter_op,
    worker_intra_op,
)


def env(
    role="worker", backend="local", strategy="ps", worker_threads=0, max_workers=1, cores=2, worker_cpu="1", step=0
):
    intra = worker_intra_op(worker_threads, backend, strategy, max_workers, cores, worker_cpu)
    return pools_env(role, backend == "local", intra, worker_inter_op(intra, backend == "local", step))


@pytest.mark.parametrize("strategy", ["ps", "allreduce"])
@pytest.mark.parametrize(
    "cores, max_workers, intra",
    [(2, 1, "2"), (2, 2, "1"), (2, 3, "1"), (8, 2, "4"), (8, 3, "2"), (1, 1, "1")],
)
def test_a_local_worker_gets_the_cores_shared_among_the_jobs_workers(strategy, cores, max_workers, intra):
    want = {INTRA_OP_ENV: intra, INTER_OP_ENV: "1"}
    assert env(strategy=strategy, cores=cores, max_workers=max_workers) == want


@pytest.mark.parametrize("strategy", ["ps", "allreduce"])
def test_a_local_shard_runs_one_thread_a_pool_whatever_the_workers_get(strategy):
    assert env("ps", strategy=strategy, worker_threads=4, cores=16) == {INTRA_OP_ENV: "1", INTER_OP_ENV: "1"}


@pytest.mark.parametrize(
    "cores, max_workers, worker_threads, inter",
    [(2, 1, 0, "2"), (8, 2, 0, "2"), (2, 2, 0, "1"), (2, 1, 1, "1"), (2, 4, 3, "2")],
)
def test_a_heavy_step_on_two_or_more_intra_op_threads_gets_a_second_inter_op_thread(
    cores, max_workers, worker_threads, inter
):
    got = env(cores=cores, max_workers=max_workers, worker_threads=worker_threads, step=HEAVY_MINIBATCH)
    assert got[INTER_OP_ENV] == inter
    assert (
        env(cores=cores, max_workers=max_workers, worker_threads=worker_threads, step=HEAVY_MINIBATCH - 1)[INTER_OP_ENV]
        == "1"
    )
    assert INTER_OP_ENV not in env(backend="kubernetes", worker_cpu="4", step=HEAVY_MINIBATCH)


def test_multiply_adds_count_each_kernel_at_the_positions_it_is_applied_at():
    import keras

    pixels = keras.Input(shape=(64,))
    hidden = keras.layers.Dense(128)(pixels)
    mlp = keras.Model(pixels, keras.layers.Dense(10)(hidden))
    assert multiply_adds(mlp) == 64 * 128 + 128 * 10

    image = keras.Input(shape=(8, 8, 1))
    conv = keras.layers.Conv2D(32, 3, padding="same")(image)  # 9 * 32 weights at each of 64 pixels
    pooled = keras.layers.MaxPooling2D()(conv)  # no kernel: nothing
    cnn = keras.Model(image, keras.layers.Dense(10)(keras.layers.Flatten()(pooled)))
    assert multiply_adds(cnn) == 9 * 32 * 64 + 4 * 4 * 32 * 10

    nested = keras.Sequential([keras.Input(shape=(8, 8, 1)), cnn, keras.layers.Dense(3)])
    assert multiply_adds(nested) == multiply_adds(cnn) + 10 * 3


def test_the_parameters_help_gives_the_heavy_steps_threshold():
    help_text = next(p.help for p in spec.PARAMS if p.name == "worker_threads")
    assert f"{HEAVY_MINIBATCH // 1_000_000} M multiply-adds a minibatch" in help_text


def test_the_sample_models_fall_either_side_of_a_heavy_step():
    from elastic_step.model_def import load_model_def

    mlp, cnn = (load_model_def(p).model() for p in ("samples/digits/model.py", "bench/models/digits_cnn.py"))
    assert multiply_adds(mlp) * 64 < HEAVY_MINIBATCH <= multiply_adds(cnn) * 64


def test_worker_threads_given_wins_over_the_rule():
    assert env(worker_threads=1, cores=8) == {INTRA_OP_ENV: "1", INTER_OP_ENV: "1"}
    assert env(worker_threads=3, max_workers=4) == {INTRA_OP_ENV: "3", INTER_OP_ENV: "1"}
    assert env(backend="kubernetes", worker_threads=3, worker_cpu="8") == {INTRA_OP_ENV: "3"}


@pytest.mark.parametrize(
    "worker_cpu, intra",
    [("1", "1"), ("2", "2"), ("1500m", "2"), ("2000m", "2"), ("250m", "1"), ("1.5", "2"), ("4e0", "4")],
)
def test_a_pod_worker_gets_its_own_cpu_not_the_nodes_cores(worker_cpu, intra):
    for strategy in ("ps", "allreduce"):
        assert env(backend="kubernetes", strategy=strategy, worker_cpu=worker_cpu, cores=64) == {INTRA_OP_ENV: intra}


@pytest.mark.parametrize("worker_cpu", ["", "0", "0m"])
def test_a_pod_worker_without_a_cpu_keeps_tensorflows_pools(worker_cpu):
    assert env(backend="kubernetes", worker_cpu=worker_cpu) == {}


def test_a_pod_shard_keeps_tensorflows_pools():
    assert env("ps", backend="kubernetes", worker_cpu="2") == {}


@pytest.mark.parametrize("quantity, cores", [("1", 1), ("999m", 1), ("1001m", 2), ("0.5", 1), ("3", 3), ("2Gi", None)])
def test_cpu_cores_rounds_a_quantity_up(quantity, cores):
    assert cpu_cores(quantity) == cores


def test_worker_threads_from_the_command_line_to_the_config():
    args = build_parser().parse_args(["train", "--model-def", "m.py", "--output", "o", "--worker-threads", "2"])
    assert TrainConfig(**spec.values(args, spec.TRAIN)).validate().worker_threads == 2
    args = build_parser().parse_args(["train", "--model-def", "m.py", "--output", "o"])
    assert TrainConfig(**spec.values(args, spec.TRAIN)).worker_threads == 0  # automatic


def test_worker_threads_from_a_pipeline_to_its_training_step():
    assert spec.step_values({"worker_threads": 2, "threshold": 0.5}, spec.ELASTIC_TRAIN) == {"worker_threads": 2}
    from elastic_step.pipelines import argo
    from elastic_step.pipelines.compile import _v1

    assert argo.PARAMETERS["worker-threads"][0] == "0"
    assert "worker_threads" in {i["name"] for i in _v1("image")[spec.ELASTIC_TRAIN]["inputs"]}


def test_negative_worker_threads_is_a_clear_error():
    cfg = TrainConfig(model_def="m.py", train_data="t", output="o", worker_threads=-1)
    with pytest.raises(ConfigError, match="--worker-threads must be >= 0"):
        cfg.validate()
