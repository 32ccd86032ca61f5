"""What every worker and PS process shares: its command line, and its client of the master.

The backend starts `python -m elastic_step.worker|ps --master ADDR --index I ...`; the job token
comes from the environment (ELASTIC_STEP_TOKEN: a Secret on Kubernetes), never the command line.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import elastic_pb2_grpc as pb_grpc
from elastic_step.proto import rpc

TOKEN_ENV = "ELASTIC_STEP_TOKEN"
# Exit code of an instance that failed through the user's model or data: the master does not
# relaunch it, it fails the job with the reported error.
EXIT_USER_ERROR = 3


# Set by the local backend: the master's pid. Its instances die with it, as pods go with their owner
# on Kubernetes, so a SIGKILLed master leaves no process behind to push into shards nobody will read.
PARENT_ENV = "ELASTIC_STEP_PARENT_PID"


def die_with_parent() -> None:
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):   # it died before we asked
        os._exit(1)


def quiet_tensorflow() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def instance_argv(role: str, master: str, index: int, model_def: str, num_ps: int, seed: int,
                  minibatch_size: int, host: str = "", strategy: str = "ps",
                  global_batch: str = "scaled") -> list[str]:
    argv = [sys.executable, "-m", f"elastic_step.{role}", "--master", master, "--index", str(index),
            "--model-def", model_def, "--num-ps", str(num_ps), "--seed", str(seed),
            "--minibatch-size", str(minibatch_size)]
    if strategy != "ps":
        argv += ["--strategy", strategy, "--global-batch", global_batch]
    return argv + (["--host", host] if host else [])


def parse_args(role: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m elastic_step.{role}")
    p.add_argument("--master", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--model-def", required=True)
    p.add_argument("--num-ps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minibatch-size", type=int, default=64)
    p.add_argument("--strategy", default="ps", choices=["ps", "allreduce"])
    p.add_argument("--global-batch", default="scaled", choices=["scaled", "fixed"])
    p.add_argument("--host", default=os.environ.get("ELASTIC_STEP_POD_IP", "127.0.0.1"),
                   help="address this instance serves on and advertises (PS)")
    args = p.parse_args(argv)
    die_with_parent()
    args.token = os.environ.get(TOKEN_ENV, "")
    if not args.token:
        p.error(f"{TOKEN_ENV} is not set: the master passes the job token in the environment")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {role}-{args.index} %(levelname)s %(message)s")
    return args


class MasterClient:
    def __init__(self, address: str, token: str, role: str, index: int):
        self.token = token
        self.me = pb.Instance(role=role, index=index)
        self._channel = rpc.channel(address)
        self.stub = pb_grpc.MasterStub(self._channel)

    def register(self, address: str = "") -> pb.RegisterResponse:
        return rpc.call(self.stub.Register, pb.RegisterRequest(token=self.token, instance=self.me,
                                                               address=address))

    def get_task(self, ahead_of: int | None = None) -> pb.GetTaskResponse:
        return rpc.call(self.stub.GetTask, pb.GetTaskRequest(token=self.token, instance=self.me, ahead_of=ahead_of))

    def report(self, task_id: int, watermark: int, records: int, loss: float, duplicate: bool) -> pb.ProgressResponse:
        """`stop`: the master refused the report (the lease is no longer ours); `hold`: a checkpoint is cut."""
        return rpc.call(self.stub.ReportProgress, pb.ProgressReport(
            token=self.token, instance=self.me, task_id=task_id, watermark=watermark,
            records=records, loss=loss, duplicate=duplicate))

    def hold(self, stop) -> None:
        """Wait while the master cuts a checkpoint (this worker has nothing in flight), or until `stop`."""
        while not stop.is_set():
            if rpc.call(self.stub.Hold, pb.HoldRequest(token=self.token, instance=self.me, wait_s=1.0),
                        timeout=10).released:
                return

    def heartbeat(self) -> bool:
        """True when the master asks this instance to stop."""
        return rpc.call(self.stub.Heartbeat, pb.HeartbeatRequest(token=self.token, instance=self.me),
                        timeout=10, retry_for=10).stop

    def fail(self, kind: str, error: BaseException) -> None:
        try:
            rpc.call(self.stub.ReportFailure, pb.FailureReport(
                token=self.token, instance=self.me, kind=kind, message=str(error),
                traceback="".join(traceback.format_exception(error))), timeout=10, retry_for=10)
        except Exception:  # noqa: BLE001 - the exit code still tells the master
            logging.exception("could not report the failure to the master")

    def close(self) -> None:
        self._channel.close()
