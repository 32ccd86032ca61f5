"""A worker process: `python -m elastic_step.worker --master ADDR --index I ...`.

Leases a task, reads exactly its record range, trains minibatch by minibatch and reports a
watermark after each pushed minibatch. On SIGTERM it finishes and reports the minibatch in
hand, then exits 0: graceful scale-in, nothing replayed.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

from elastic_step.errors import ConfigError, DataError, ElasticStepError
from elastic_step.instance import EXIT_FENCED, EXIT_USER_ERROR, fenced, parse_args
from elastic_step.instance.master_client import MasterClient
from elastic_step.util import phases
from elastic_step.util.phases import span
from elastic_step.util.process import quiet_tensorflow
from elastic_step.worker.device import training_device
from elastic_step.worker.records import minibatch_of

log = logging.getLogger("elastic_step.worker")

# The kind of failure a user's error is reported as, by its class (the first that matches).
KINDS = ((DataError, "data_error"), (ConfigError, "config_error"))


def run_allreduce(args, model_def, master: MasterClient, stop: threading.Event) -> int:
    """--strategy allreduce: see worker/allreduce_loop.py."""
    import keras

    from elastic_step.data.reader import ReaderPool
    from elastic_step.worker import collective
    from elastic_step.worker.allreduce_loop import AllReduceTrainer, AllReduceWorker
    from elastic_step.worker.finite import NonFinite

    keras.utils.set_random_seed(args.seed)
    trainer = AllReduceTrainer(
        model_def, model_def.model(), NonFinite(args.skip_non_finite), weight_column=args.weight_column
    )
    state = collective.StateProvider()
    state.snapshot = trainer.state
    me = f"worker-{args.index}"
    ring = collective.Ring(args.token, me, args.host, launch=args.launch)
    server, port = collective.serve(collective.CollectiveService(args.token, state, ring.port), args.host)
    readers = ReaderPool()
    try:
        worker = AllReduceWorker(
            master,
            args.token,
            trainer,
            readers,
            ring,
            state,
            f"{args.host}:{port}",
            args.minibatch_size,
            args.global_batch,
            stop,
        )
        why = worker.run()
        log.info("training over (%s) at step %d: serving my state until the master stops me", why, worker.applied_step)
        log.info("where my steps' time went: %s", worker.profile)
        # The master pulls the final weights from rank 0: keep the Collective server up until told.
        deadline = time.monotonic() + 300
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                if master.heartbeat():
                    break
            except Exception:  # noqa: BLE001 - the master is gone: nothing left to serve
                break
            stop.wait(0.2)
        return 0
    finally:
        readers.close()
        ring.close()
        server.stop(grace=0.5)


def shards(master: MasterClient, stop: threading.Event, newer_than: int = -1):
    """Register until the master hands out every shard's address, at a generation past `newer_than`
    (it withholds them while the shards start, or are restored after a loss). None once stopped."""
    while not stop.is_set():
        info = master.register()
        if info.ps_generation > newer_than and all(info.ps_addresses):
            return info
        stop.wait(0.2)
    return None


def run(args, model_def, master: MasterClient, stop: threading.Event) -> int:
    import keras

    from elastic_step.data.reader import ReaderPool
    from elastic_step.ps.api import Placement
    from elastic_step.ps.client import PSClient, ShardsMoved
    from elastic_step.worker.finite import NonFinite
    from elastic_step.worker.loop import PUSH_DEPTH, REPORT_INTERVAL_S, train_tasks
    from elastic_step.worker.trainer import PSTrainer

    keras.utils.set_random_seed(args.seed)
    model = model_def.model()
    placement = Placement.of(model, args.num_ps)
    info = shards(master, stop)
    if info is None:  # stopped before the shards were up
        return 0
    depth = info.pushes_in_flight or PUSH_DEPTH
    me = (args.index, args.launch)  # every push says whose launch it is: a fenced one's are refused
    ps = PSClient(list(info.ps_addresses), args.token, placement, pushes_in_flight=depth, pusher=me)
    per_push = info.minibatches_per_push or 1
    trainer = PSTrainer(
        model_def,
        model,
        ps,
        placement,
        pushes_in_flight=depth,
        generation=info.ps_generation,
        minibatch_size=info.minibatch_size,
        minibatches_per_push=per_push,
        weight_column=args.weight_column,
        non_finite=NonFinite(args.skip_non_finite, master.report_skipped),
    )
    readers = ReaderPool()

    def rejoin() -> None:
        """Wait until the master has every shard back (relaunched, restored to its last checkpoint, a new
        generation), then push to them; again if they move meanwhile (one more shard lost, or frozen)."""
        while (info := shards(master, stop, newer_than=trainer.generation)) is not None:
            new = PSClient(list(info.ps_addresses), args.token, placement, pushes_in_flight=depth, pusher=me)
            try:
                trainer.reconnect(new, info.ps_generation).close()
            except ShardsMoved as e:
                log.warning("the PS shards moved again (%s): registering again", str(e).splitlines()[0][:200])
                continue
            log.info("the PS shards are back at generation %d: training on", info.ps_generation)
            return

    try:
        try:
            trainer.refresh_dense()
        except ShardsMoved as e:  # lost or frozen before this worker's first pull: as after any loss, not a crash
            log.warning("the PS shards moved before my first pull (%s): registering again", str(e).splitlines()[0][:99])
            rejoin()
        with span("worker: training, whole"):
            why = train_tasks(
                master,
                trainer,
                readers,
                info.minibatch_size * per_push,
                stop,
                report_interval_s=info.report_interval_s or REPORT_INTERVAL_S,
                pushes_in_flight=depth,
                rejoin=rejoin,
            )
        log.info("exiting: %s", "no more tasks" if why == "done" else "SIGTERM, last minibatch reported")
        return 0
    finally:
        trainer.close()
        readers.close()
        ps.close()
        phases.dump(f"worker-{args.index}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args("worker", argv)
    quiet_tensorflow()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    device = training_device()
    log.info("training on %s", device)
    master = MasterClient(args.master, args.token, "worker", args.index, args.launch, device=device)
    model_def = None
    from elastic_step.faults.process import install_worker_faults

    install_worker_faults(f"worker-{args.index}")  # tests: ELASTIC_STEP_COLLECTIVE_CHAOS, ELASTIC_STEP_SLOW
    try:
        from elastic_step.model_def import load_model_def

        model_def = load_model_def(args.model_def)
        return (run_allreduce if args.strategy == "allreduce" else run)(args, model_def, master, stop)
    except ElasticStepError as e:
        if (refusal := fenced(e)) is not None:
            log.error("%s", refusal)
            return EXIT_FENCED
        log.error("%s", e)
        master.fail(next((k for c, k in KINDS if isinstance(e, c)), "model_error"), e, minibatch_of(e))
        return EXIT_USER_ERROR
    except Exception as e:
        if (refusal := fenced(e)) is not None:
            # The master gave this launch up (declared it lost) and requeued its lease: nothing of ours is applied
            # any more, and a successor trains in our place. Leave at once, reporting nothing.
            log.error("%s", refusal)
            return EXIT_FENCED
        if model_def is None or not model_def.raised_in_user_code(e):
            # Not known to be the user's: the master relaunches, unless another instance failed the same way on
            # the same minibatch (master/relaunch.py). The exit code and traceback follow.
            log.error("failed%s: %s: %s", f" on {minibatch_of(e)}" if minibatch_of(e) else "", type(e).__name__, e)
            master.fail("internal", e, minibatch_of(e))
            raise
        # Raised in the user's code on a thread of ours (a push, a lease read ahead): still theirs,
        # reported once as such, not relaunched into a crash loop.
        error = model_def.user_error(e, "training")
        log.error("%s", error)
        master.fail("model_error", error, minibatch_of(e))
        return EXIT_USER_ERROR
    finally:
        master.close()


if __name__ == "__main__":
    sys.exit(main())
