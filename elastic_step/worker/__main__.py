"""A worker process: `python -m elastic_step.worker --master ADDR --index I ...`.

Runs the job's strategy (ps/process.py, allreduce/process.py): leases a task, reads exactly its record range,
trains minibatch by minibatch and reports a watermark after each pushed minibatch. On SIGTERM it finishes and
reports the minibatch in hand, then exits 0: graceful scale-in, nothing replayed. An error is reported to the
master here, as the user's (not relaunched) or not.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from elastic_step.errors import ConfigError, DataError, ElasticStepError
from elastic_step.instance.api import EXIT_FENCED, EXIT_USER_ERROR, fenced
from elastic_step.instance.master_client import MasterClient
from elastic_step.instance.startup import start
from elastic_step.util.process import quiet_tensorflow
from elastic_step.worker.device import training_device
from elastic_step.worker.records import minibatch_of

log = logging.getLogger("elastic_step.worker")

# The kind of failure a user's error is reported as, by its class (the first that matches).
KINDS = ((DataError, "data_error"), (ConfigError, "config_error"))


def main(argv: list[str] | None = None) -> int:
    args = start("worker", argv)
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
        from elastic_step.data import statistics_of
        from elastic_step.model_def import load_model_def

        model_def = load_model_def(args.model_def, statistics_of(args.train_data))
        if args.strategy == "allreduce":
            from elastic_step.worker.allreduce.process import run
        else:
            from elastic_step.worker.ps.process import run
        return run(args, model_def, master, stop)
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
