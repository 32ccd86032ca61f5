"""The worker process of `--strategy allreduce`: its trainer, its ring and Collective service, and the member that
drives them (member.py), wired from the worker's command line."""

from __future__ import annotations

import logging
import threading
import time

from elastic_step.data.reader import ReaderPool
from elastic_step.instance.master_client import MasterClient
from elastic_step.worker.allreduce import collective
from elastic_step.worker.allreduce.member import AllReduceWorker
from elastic_step.worker.allreduce.trainer import AllReduceTrainer
from elastic_step.worker.finite import NonFinite

log = logging.getLogger("elastic_step.worker")


def run(args, model_def, master: MasterClient, stop: threading.Event) -> int:
    """Train as a member until the job ends (`stop`: SIGTERM), then serve this member's state until the master
    stops it: the master pulls the final weights from rank 0."""
    import keras

    keras.utils.set_random_seed(args.seed)
    trainer = AllReduceTrainer(
        model_def, model_def.model(), NonFinite(args.skip_non_finite), weight_column=args.weight_column
    )
    state = collective.StateProvider(trainer.state)
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
