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

from elastic_step.errors import DataError, ElasticStepError
from elastic_step.instance import EXIT_USER_ERROR, MasterClient, parse_args, quiet_tensorflow

log = logging.getLogger("elastic_step.worker")


def run(args, master: MasterClient, stop: threading.Event) -> int:
    import keras

    from elastic_step.data.reader import ReaderPool
    from elastic_step.model_def import load_model_def
    from elastic_step.ps.api import Placement
    from elastic_step.ps.client import PSClient
    from elastic_step.worker.loop import train_tasks
    from elastic_step.worker.trainer import PSTrainer

    model_def = load_model_def(args.model_def)
    keras.utils.set_random_seed(args.seed)
    model = model_def.model()
    placement = Placement.of(model, args.num_ps)
    info = master.register()
    ps = PSClient(list(info.ps_addresses), args.token, placement)
    trainer = PSTrainer(model_def, model, ps, placement)
    trainer.set_dense(ps.pull_dense())
    readers = ReaderPool()
    try:
        why = train_tasks(master, trainer, readers, info.minibatch_size, stop)
        log.info("exiting: %s", "no more tasks" if why == "done" else "SIGTERM, last minibatch reported")
        return 0
    finally:
        readers.close()
        ps.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args("worker", argv)
    quiet_tensorflow()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    master = MasterClient(args.master, args.token, "worker", args.index)
    try:
        return run(args, master, stop)
    except ElasticStepError as e:
        log.error("%s", e)
        master.fail("data_error" if isinstance(e, DataError) else "model_error", e)
        return EXIT_USER_ERROR
    finally:
        master.close()


if __name__ == "__main__":
    sys.exit(main())
