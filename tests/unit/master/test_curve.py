"""The eval curve (master/curve.py): its budget rule, its points (what evaluate() reports, on the evaluator
thread at a lower priority), and its pulls from the parameter servers through one client."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading

import numpy as np
import pytest

from elastic_step.master.curve import (
    EPOCH_EVAL_RECORDS,
    EVAL_SHARE,
    EVALUATOR_NICENESS,
    EvalCurve,
    PointCost,
    ShardPuller,
    epochs_per_point,
    point_due,
    yield_to_training,
)
from elastic_step.master.failures import FailureReports
from elastic_step.master.leases.coordinator import Coordinator
from elastic_step.master.leases.ledger import Ledger, ShardInfo


def test_the_evaluator_thread_yields_the_cores_to_training_and_the_master_keeps_its_priority():
    before = os.getpriority(os.PRIO_PROCESS, 0)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, initializer=yield_to_training) as evaluator:
        niceness = evaluator.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert niceness == max(before, EVALUATOR_NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # the calling thread's own


def test_a_point_yields_tensorflows_own_threads_too_where_its_pass_runs():
    """TensorFlow runs a pass's ops on its own pools (threads named tf_*), made at nice 0 by whatever ran the
    master's first op; the witness is each thread's niceness as the kernel tells it."""
    tf = pytest.importorskip("tensorflow")
    tf.function(lambda x: tf.reduce_sum(tf.matmul(x, x)))(tf.ones([64, 64]))  # the pools exist now
    names = {int(t): open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")}
    pools = [t for t, name in names.items() if name.startswith("tf_")]
    assert pools
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as other:
        other.submit(yield_to_training).result()
    for t in pools:
        assert os.getpriority(os.PRIO_PROCESS, t) >= EVALUATOR_NICENESS, names[t]


# ---------------------------------------------------------------------- the budget
def test_a_point_is_due_once_the_last_took_at_most_its_share_of_the_time_since_it_started():
    assert EVAL_SHARE == 0.02
    assert not point_due(0.031, 1.0)  # 3.1 % of the time since
    assert point_due(0.031, 1.6)  # 1.9 %
    assert point_due(0.031, 10.0)
    assert point_due(0.0, 0.0)  # a point that cost nothing never waits
    assert not point_due(0.1, 1.0, share=0.05) and point_due(0.1, 2.0, share=0.05)


@pytest.mark.parametrize(
    "point_s, epoch_s",
    [(0.031, 0.1), (0.03125, 0.125), (0.02, 0.1), (0.001, 0.1), (0.5, 2.0), (0.03, 0.01), (0.002, 0.1)],
)
def test_the_points_every_n_epochs_it_reports_are_where_the_rule_puts_them(point_s, epoch_s):
    """A point, then epochs of `epoch_s` end one after another: the first epoch whose end the rule takes a
    point after is the n the master's log reports."""
    n = next(k for k in range(1, 10_000) if point_due(point_s, k * epoch_s))
    assert epochs_per_point(point_s, epoch_s) == n


def test_the_logs_example_a_31_ms_point_against_epochs_of_a_tenth_of_a_second_is_one_point_every_16_epochs():
    assert epochs_per_point(0.031, 0.10) == 16
    assert epochs_per_point(0.001, 1.0) == 1  # cheap against the epoch: a point after every one
    assert epochs_per_point(0.5, 0.0) == 1


# ---------------------------------------------------------------------- the points
keras = pytest.importorskip("keras")

from elastic_step.data.prep import prepare  # noqa: E402
from elastic_step.evaluation import evaluate  # noqa: E402
from elastic_step.master.tensorboard import TensorBoardLog  # noqa: E402
from elastic_step.model_def import load_model_def  # noqa: E402
from tests.unit.test_evaluation import MODEL  # noqa: E402 - the same small model


@pytest.fixture
def job(tmp_path):
    """(model definition, eval manifest, the job's weights as a model, coordinator, tensorboard log, failures)."""
    rng = np.random.default_rng(2)
    rows = [f"{a},{b},{c}\n" for a, b, c in zip(rng.normal(size=120), rng.normal(size=120), rng.integers(0, 3, 120))]
    (tmp_path / "d.csv").write_text("a,b,label\n" + "".join(rows))
    data = prepare(str(tmp_path / "d.csv"), str(tmp_path / "data"), label="label", eval_fraction=0.5, shard_rows=25)
    (tmp_path / "m.py").write_text(MODEL)
    md = load_model_def(str(tmp_path / "m.py"))
    keras.utils.set_random_seed(0)
    trained = md.model()
    coord = Coordinator(Ledger([ShardInfo("s", 100)], 50, 10, 10), num_ps=0)
    board = TensorBoardLog.for_job(str(tmp_path / "out"), 100, environ={})
    failures = FailureReports(coord.timeline, job_failed=coord.finished.set)
    yield md, data.eval, trained, coord, board, failures
    board.close()


def curve_of(job, pull=None, model_def=None) -> EvalCurve:
    md, manifest, trained, coord, board, failures = job
    pull = pull or (lambda model: model.set_weights(trained.get_weights()))  # as allreduce's pull is given
    return EvalCurve(model_def or md, manifest, coord, [], board, pull, failures)


def test_each_point_is_what_evaluate_reports_on_the_weights_of_its_epoch(job):
    md, manifest, trained, coord, _, _ = job
    curve = curve_of(job)
    expected = {}
    curve.prepare()  # as the master does while the instances start
    curve.initial_point()
    expected[-1] = evaluate(trained, md, manifest, limit=EPOCH_EVAL_RECORDS)
    curve.tick(0, 0.0)  # the pump's first turn
    for epoch in (1, 2):
        curve._pending.result()  # the point before is done: this epoch's end is not skipped
        trained.set_weights([w + 0.3 for w in trained.get_weights()])  # the epoch's training
        expected[epoch - 1] = evaluate(trained, md, manifest, limit=EPOCH_EVAL_RECORDS)
        curve.last = None  # no budget in the way here (its own test below)
        curve.tick(epoch, 0.0)
    curve.stop()
    curve.close()
    assert [p["epoch"] for p in curve.history] == [-1, 0, 1]
    for point in curve.history:
        r = expected[point["epoch"]]
        assert point == {
            "t": point["t"],
            "epoch": point["epoch"],
            **{k: round(v, 5) for k, v in r.items() if isinstance(v, float)},
        }
    assert curve.last is not None and curve.last.epoch == 1


def test_an_epoch_that_ends_while_a_point_is_computed_has_none_and_the_next_one_does(job):
    release = threading.Event()
    _, _, trained, _, _, _ = job

    def pull(model):  # the job's weights, after a pull that waits until the test lets it go
        release.wait(timeout=60)
        model.set_weights(trained.get_weights())

    curve = curve_of(job, pull=pull)
    curve.tick(0, 0.0)
    curve.tick(1, 0.0)  # epoch 0 ended: its point starts and waits in its pull
    assert curve.computing()
    curve.tick(2, 0.0)  # epoch 1 ended meanwhile: skipped, not taken late
    release.set()
    curve._pending.result()
    curve.last = None
    curve.tick(3, 0.0)
    curve.stop()
    curve.close()
    assert [p["epoch"] for p in curve.history] == [0, 2]


def test_a_point_waits_until_the_last_took_at_most_its_share_and_the_master_says_so_once(job, caplog):
    curve = curve_of(job)
    curve.tick(0, 0.0)
    curve.last = PointCost(epoch=-1, started=100.0, seconds=0.031)  # the initial weights' point: 31 ms
    with caplog.at_level(logging.INFO, logger="elastic_step.master"):
        curve.tick(1, 100.1)  # epoch 0 ended 0.1 s after: 31 %
        curve.tick(2, 100.2)
    assert not curve.computing() and curve.history == []
    said = [r.getMessage() for r in caplog.records if "eval curve" in r.getMessage()]
    assert said == [
        "the eval curve: a point takes 31 ms against epochs of 0.10 s; a point every 16 epochs keeps it within "
        "2 % of training"
    ]
    curve.tick(16, 101.6)  # 1.6 s after: 1.9 %
    curve.stop()
    curve.close()
    assert [p["epoch"] for p in curve.history] == [15]


def test_the_users_metrics_failing_fail_the_job_as_theirs(job, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        MODEL.replace('{"accuracy": keras.metrics.SparseCategoricalAccuracy(name="accuracy")}', '["accuracy"]')
    )
    md = load_model_def(str(bad))
    curve = curve_of(job, model_def=md)
    curve.tick(0, 0.0)
    curve.tick(1, 0.0)
    curve.stop()
    curve.close()
    failure = job[5].failure
    assert curve.history == []
    assert failure["kind"] == "model_error" and "eval_metrics()" in failure["message"]


# ---------------------------------------------------------------------- ps: one client for the curve's pulls
from elastic_step.proto import elastic_pb2_grpc as pb_grpc  # noqa: E402
from elastic_step.proto import rpc  # noqa: E402
from elastic_step.ps.api import Placement  # noqa: E402
from elastic_step.ps.server import ParameterServerService, ParameterShard  # noqa: E402

TOKEN = "t0ken"


def small_model(seed: int):
    keras.utils.set_random_seed(seed)
    x = keras.Input(shape=(6,))
    return keras.Model(x, keras.layers.Dense(3)(keras.layers.Dense(8, activation="relu")(x)))


class Shard:
    """A real PS shard of `small_model(seed)` on loopback gRPC, at `port` (0: any)."""

    def __init__(self, seed: int, port: int = 0):
        model = small_model(seed)
        self.weights = [w.copy() for w in model.get_weights()]
        self.service = ParameterServerService(
            ParameterShard(model, keras.optimizers.SGD(0.1), Placement.of(model, 1), 0), TOKEN
        )
        self.server = rpc.server(max_workers=4)
        pb_grpc.add_ParameterServerServicer_to_server(self.service, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(None)
        self.service.close()


def holds(model, weights) -> bool:
    return all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights))


def test_the_curves_pulls_follow_a_shard_to_its_new_address_and_a_new_client_after_a_failed_pull():
    first, second = Shard(seed=1), Shard(seed=2)
    addresses = [first.address]
    puller = ShardPuller(lambda: list(addresses), TOKEN, num_ps=1)
    model = small_model(seed=3)
    relaunched = None
    try:
        puller(model)
        assert holds(model, first.weights)
        addresses[0] = second.address  # the shard lost and relaunched: it registered at another address
        puller(model)
        assert holds(model, second.weights)
        port = second.port
        second.stop()
        with pytest.raises(Exception):  # noqa: B017 - whatever the failed pull raises, the point's business
            puller(model)
        relaunched = Shard(seed=4, port=port)  # back at the same address: the client made after the failure
        puller(model)
        assert holds(model, relaunched.weights)
    finally:
        puller.close()
        for s in (first, relaunched):
            if s is not None:
                s.stop()
