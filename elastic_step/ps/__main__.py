"""A parameter-server process: `python -m elastic_step.ps --master ADDR --index I ...`."""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading

from elastic_step.errors import ElasticStepError
from elastic_step.instance.api import EXIT_USER_ERROR
from elastic_step.instance.master_client import MasterClient
from elastic_step.instance.startup import start
from elastic_step.proto import elastic_pb2_grpc as pb_grpc
from elastic_step.proto import rpc
from elastic_step.util import phases
from elastic_step.util.process import quiet_tensorflow

log = logging.getLogger("elastic_step.ps")


def main(argv: list[str] | None = None) -> int:
    args = start("ps", argv)
    quiet_tensorflow()
    master = MasterClient(args.master, args.token, "ps", args.index)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        import keras

        from elastic_step.data import statistics_of
        from elastic_step.model_def import load_model_def
        from elastic_step.ps.api import Placement
        from elastic_step.ps.server import ParameterServerService, ParameterShard

        model_def = load_model_def(args.model_def, statistics_of(args.train_data))
        keras.utils.set_random_seed(args.seed)  # every process builds identical initial weights
        model = model_def.model()
        shard = ParameterShard(model, model_def.optimizer(), Placement.of(model, args.num_ps), args.index)
        # The model and the shard's traced functions live as long as the process: out of the collector's way,
        # so its full collections (set off by each push's garbage) do not walk their many objects while pushes
        # wait (the 2-worker digits PS comparison: about 10% more records/s).
        gc.freeze()
    except ElasticStepError as e:
        master.fail("model_error", e)
        return EXIT_USER_ERROR
    server = rpc.server(max_workers=8)
    service = ParameterServerService(shard, args.token)
    pb_grpc.add_ParameterServerServicer_to_server(service, server)
    port = server.add_insecure_port(f"{args.host}:0" if args.host != "0.0.0.0" else "0.0.0.0:0")
    server.start()
    master.register(f"{args.host}:{port}")
    log.info(
        "serving %d dense variables and %d embedding tables on %s:%d",
        len(shard.dense_names),
        len(shard.tables),
        args.host,
        port,
    )
    # Serve until the master says the job is over, or SIGTERM.
    while not stop.wait(1.0):
        try:
            if master.heartbeat(len(shard.applied), shard.skipped):
                break
        except Exception:  # noqa: BLE001 - master gone: nobody needs us any more
            log.warning("master unreachable; stopping")
            break
    server.stop(grace=2).wait()
    service.close()
    master.close()
    phases.dump(f"ps-{args.index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
