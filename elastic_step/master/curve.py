"""The eval curve: the model on (a sample of) the eval data before training and after epochs, as training goes.

Its points are `eval_history` (summary.json, TensorBoard's `eval/`, the report's chart). A point pulls the job's
current weights into a model of the evaluation's own and evaluates them on the first EPOCH_EVAL_RECORDS eval
records, on a thread of its own at a lower priority, so the master keeps handling events meanwhile. What is
made once is kept: the model, the records read and fed, the metric objects and, in `ps` mode, the client of the
shards.

What is made once is made while the instances start, before the shards open (`prepare`): its first pass
(TensorFlow's first calls cost ~10x the next) is then not taken from training.

Its budget: the curve may take at most EVAL_SHARE of training's time. A point costs about the same whatever the
epoch's length (a pull and a pass over the same records), so where epochs are short a point after every one
would cost training more than that; then an epoch's point is skipped while the last point took longer than
EVAL_SHARE of the time since it started (`point_due`), and the points fall every few epochs. The initial
weights' point and the final evaluation (on every record, at the end) always run.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from elastic_step.errors import ConfigError, ModelDefError
from elastic_step.master.failures import FailureReports
from elastic_step.util import phases
from elastic_step.util.process import own_threads

log = logging.getLogger("elastic_step.master")

EPOCH_EVAL_RECORDS = 4096  # a curve point's records, at most; the final evaluation uses all
EVAL_SHARE = 0.02  # of training's time, at most, for the curve's points
EVALUATOR_NICENESS = 10


def point_due(point_s: float, since_s: float, share: float = EVAL_SHARE) -> bool:
    """Whether the curve may take a point now: the last point took `point_s` and started `since_s` ago. Within
    its share while that point's time is at most `share` of the time since it started."""
    return point_s <= share * since_s


def epochs_per_point(point_s: float, epoch_s: float, share: float = EVAL_SHARE) -> int:
    """How many epochs apart `point_due` puts the points when one takes `point_s` and an epoch `epoch_s`."""
    if epoch_s <= 0:
        return 1
    # The tolerance: a point that takes exactly n epochs' share is due after n epochs, not n + 1.
    return max(1, math.ceil(point_s / (share * epoch_s) - 1e-9))


@dataclass(frozen=True)
class PointCost:
    """What a point took: `seconds` of wall time (its pull and evaluation), from `started` (time.time())."""

    epoch: int
    started: float
    seconds: float


class ShardPuller:
    """`ps` mode: the parameter servers' current weights into the curve's model, through one client kept from
    point to point (ps/client.py KeptClient)."""

    def __init__(self, addresses: Callable[[], list[str]], token: str, num_ps: int):
        self.addresses, self.token, self.num_ps = addresses, token, num_ps
        self._shards = None

    def __call__(self, model) -> None:
        from elastic_step.ps.api import Placement
        from elastic_step.ps.client import KeptClient, load_shards

        if self._shards is None:
            self._shards = KeptClient(self.addresses, self.token, Placement.of(model, self.num_ps))
        with self._shards.use() as client:
            load_shards(client, model)

    def close(self) -> None:
        if self._shards is not None:
            self._shards.close()


class EvalCurve:
    """The eval curve of a job. `pull(model)` loads the job's current weights into the model (closed with the
    curve when it has a `close()`); `history`: the points so far (a resumed job's come from its checkpoint),
    appended to under `coord.lock`; `failures`: the job's, where a model's error in its metrics is reported."""

    def __init__(
        self,
        model_def,
        manifest,
        coord,
        history: list[dict],
        tensorboard,
        pull,
        failures: FailureReports,
        share: float = EVAL_SHARE,
        early_stop=None,
    ):
        self.model_def, self.manifest, self.coord, self.history = model_def, manifest, coord, history
        self.failures = failures
        self.tensorboard, self.pull, self.share = tensorboard, pull, share
        # Early stopping (master/early_stop.py): a point after every epoch, which waits for it (`held`), not `tick`.
        self.early_stop = early_stop
        self._held: int | None = None  # the last held epoch a point was submitted for
        self.last: PointCost | None = None  # the last point this master took
        self._model = None
        self._batches: list | None = None  # the curve's records, read and fed once
        self._metrics: dict | None = None
        self._seen: int | None = None  # the latest epoch the pump has shown the curve
        self._thinned = False  # said so, once
        self._evaluator = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="evaluator", initializer=yield_to_training
        )
        self._pending: concurrent.futures.Future | None = None  # the last point submitted
        self._building = threading.Lock()  # the model: built by `prepare` on the evaluator or by the first pull

    def prepare(self) -> None:
        """What a point makes once (the model, the records read and fed, the metrics, a first pass), on the
        evaluator thread, now: while the instances start, before training."""
        self._evaluator.submit(self._prepare)

    def initial_point(self) -> None:
        """The initial weights' point: pulled now, on the caller's thread, before the shards open to the
        workers' pushes; evaluated on the evaluator thread."""
        model = self._built()
        started = time.time()
        self.pull(model)
        self._pending = self._evaluator.submit(self._point, -1, started, time.time() - started)

    def tick(self, epoch: int, now: float) -> None:
        """A turn of the master's pump, the ledger at `epoch`: a point for the epoch that just ended, unless one
        is being computed (so a point's weights are those of the epoch it is labelled with) or the budget says
        to skip it."""
        if self.early_stop is not None:  # every epoch's point is taken while the epoch is held
            return
        seen = self._seen
        if seen is not None and epoch <= seen:  # nothing ended since (or a rewind: its epochs had their chance)
            return
        self._seen = epoch
        if seen is None:  # the pump's first turn: what ended before it is not this turn's
            return
        if self.computing():
            return
        last = self.last
        if last is not None and not point_due(last.seconds, now - last.started, self.share):
            if not self._thinned:
                self._thinned = True
                epoch_s = (now - last.started) / max(1, epoch - 1 - last.epoch)
                log.info(
                    "the eval curve: a point takes %.0f ms against epochs of %.2f s; a point every %d epochs keeps "
                    "it within %g %% of training",
                    last.seconds * 1000,
                    epoch_s,
                    epochs_per_point(last.seconds, epoch_s, self.share),
                    self.share * 100,
                )
            return
        self._pending = self._evaluator.submit(self._point, epoch - 1)

    def held(self, epoch: int) -> None:
        """Early stopping: epoch `epoch` is committed and waits for its point, which decides whether training goes
        on. Its weights stay as they are meanwhile, so the point may queue behind one in progress."""
        if self._held == epoch:
            return
        self._held = epoch
        self._pending = self._evaluator.submit(self._point, epoch)

    def computing(self) -> bool:
        """A point is being computed (it holds the hang clocks: see master/gray/policy.py)."""
        return self._pending is not None and not self._pending.done()

    def stop(self) -> None:
        """Wait for the point in progress, and take no more (before the final model is built: no model is
        built in two threads at once)."""
        self._evaluator.shutdown(wait=True)

    def close(self) -> None:
        """Take no more points; the pull's client is closed once the point in progress, if any, is done."""
        self._evaluator.shutdown(wait=False, cancel_futures=True)
        close = getattr(self.pull, "close", None)
        if close is None:
            return
        if self._pending is None:
            close()
        else:  # at once when it is done already, else on the evaluator thread when it is
            self._pending.add_done_callback(lambda _: close())

    # ------------------------------------------------------------------ a point
    def _built(self):
        with self._building:
            if self._model is None:
                self._model = self.model_def.model()
            return self._model

    def _prepare(self) -> None:
        from elastic_step.evaluation import eval_batches, evaluate_batches

        if self._batches is not None:
            return
        with phases.phase("master: prepare the eval curve (model, records, a first pass)"):
            model = self._built()
            self._metrics = self.model_def.eval_metrics()
            self._batches = list(eval_batches(self.model_def, self.manifest, limit=EPOCH_EVAL_RECORDS))
            # The first pass of a model, its loss and metrics costs ~10x the next (TensorFlow's first calls):
            # once, on a batch, so that a point's cost, which spaces the points, is what each one costs.
            evaluate_batches(model, self.model_def, self._batches[:1], self._metrics)

    def _point(self, epoch: int, started: float | None = None, pulled_s: float = 0.0) -> None:
        """Epoch `epoch`'s point (-1: the initial weights, pulled already at `started`, in `pulled_s`). What is
        done once (the model, the records, the metrics, a first pass) is not counted in its cost."""
        from elastic_step.evaluation import evaluate_batches

        try:
            self._prepare()  # done already, unless `prepare` was not called or failed
            yield_to_training()  # TensorFlow's threads made since: the pass runs on them
            with phases.phase("master: evaluate an epoch (pull, then the eval records)"):
                model = self._built()
                if started is None:
                    started = time.time()
                    self.pull(model)
                    pulled_s = time.time() - started
                evaluating = time.time()
                r = evaluate_batches(model, self.model_def, self._batches, self._metrics)
                self.last = PointCost(epoch, started, pulled_s + time.time() - evaluating)
        except ModelDefError as e:  # the user's loss or metrics: theirs, reported once, now
            self.failures.report("master", "model_error", str(e), "")
            return
        except Exception as e:  # noqa: BLE001 - a curve point is not worth failing the job for
            log.warning("evaluation after epoch %d failed: %s", epoch, e)
            if self.early_stop is not None and epoch >= 0:  # the held epoch goes on, without this point
                self.coord.epoch_evaluated(epoch, last=False)
            return
        log.debug("the eval curve: epoch %d's point took %.1f ms", epoch, self.last.seconds * 1000)
        point = {
            "t": round(time.time() - self.coord.timeline.t0, 3),
            "epoch": epoch,
            **{k: round(v, 5) for k, v in r.items() if isinstance(v, float)},
        }
        with self.coord.lock:
            self.history.append(point)
        self.tensorboard.evaluation(point)
        if self.early_stop is not None and epoch >= 0:
            self._early_stop(epoch, point, model)

    def _early_stop(self, epoch: int, point: dict, model) -> None:
        try:
            last = self.early_stop.after_epoch(epoch, point, model.get_weights)
        except ConfigError as e:  # a metric the evaluation does not report
            self.failures.report("master", "config_error", str(e), "")
            return
        if last:
            log.info("early stopping after epoch %d: %s", epoch, self.early_stop.summary(epoch + 1)["reason"])
        self.coord.epoch_evaluated(epoch, last)


def yield_to_training() -> None:
    """The evaluator thread's start, and each point's: the curve's points run at a lower CPU priority than the
    step's own threads (Linux: a thread's niceness is its own). That is the evaluator thread and TensorFlow's named
    threads in the master (`tf_*`, its inter-op pool: made, at nice 0, by whatever first ran an op, such as the
    model's check at the job's start; the master runs TensorFlow for nothing else while training). Its intra-op
    threads, which run much of a pass, carry the process's name: they are not told apart, and keep their priority.
    On the local backend the workers and shards share the master's cores, and an evaluation then
    takes what they leave instead of slowing their steps; where the master has a pod of its own, nothing competes
    and nothing changes."""
    for thread in [threading.get_native_id(), *_tensorflow_threads()]:
        try:
            niceness = max(os.getpriority(os.PRIO_PROCESS, thread), EVALUATOR_NICENESS)  # never up
            os.setpriority(os.PRIO_PROCESS, thread, niceness)
        except (AttributeError, OSError) as e:  # not Linux, not allowed, or gone: the curve costs what it costs
            log.debug("thread %d keeps its priority: %s", thread, e)


def _tensorflow_threads() -> list[int]:
    """The ids of this process's threads that TensorFlow named (its inter-op pool): none where /proc is not."""
    return [t.tid for t in own_threads() if t.name.startswith("tf_")]
