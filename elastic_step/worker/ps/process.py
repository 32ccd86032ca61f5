"""The worker process of `--strategy ps`: its client of the shards, its trainer and its task loop (loop.py), wired
from the worker's command line and what the master tells it at registration."""

from __future__ import annotations

import logging
import threading

from elastic_step.data.reader import ReaderPool
from elastic_step.instance.master_client import MasterClient
from elastic_step.ps.api import Placement
from elastic_step.ps.client import PSClient, ShardsMoved
from elastic_step.util import phases
from elastic_step.util.phases import span
from elastic_step.worker.finite import NonFinite
from elastic_step.worker.ps.loop import PUSH_DEPTH, REPORT_INTERVAL_S, TaskLoop
from elastic_step.worker.ps.trainer import PSTrainer

log = logging.getLogger("elastic_step.worker")


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
    """Train leases until the master says DONE or `stop` is set (SIGTERM: the minibatch in hand is reported)."""
    import keras

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
            why = TaskLoop(
                master,
                trainer,
                readers,
                info.minibatch_size * per_push,
                stop,
                report_interval_s=info.report_interval_s or REPORT_INTERVAL_S,
                pushes_in_flight=depth,
                rejoin=rejoin,
            ).run()
        log.info("exiting: %s", "no more tasks" if why == "done" else "SIGTERM, last minibatch reported")
        return 0
    finally:
        trainer.close()
        readers.close()
        ps.close()
        phases.dump(f"worker-{args.index}")
