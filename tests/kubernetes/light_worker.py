"""A light simulated worker, for fleets of hundreds of pods on the process kubelet: no TensorFlow, no data.

It does what elastic_step.worker does with the master, minus the compute: GetTask, then one ReportProgress per
minibatch, `THINK_S` seconds apart, until the master says DONE. It registers before each lease, so that a master
restarted under it (the same address: its pod was kept) learns of it within one lease. A call the master cancels is
made again: a master stopped in-process (as the fleet's tests and bench stop it) cancels the calls in flight, where
a killed one's connection drops, which the client retries. The job token comes from the pod's Secret, as a real
worker's does.

    python tests/kubernetes/light_worker.py ADDRESS INDEX THINK_S
"""

from __future__ import annotations

import os
import sys
import time

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from elastic_step.instance.api import TOKEN_ENV
from elastic_step.instance.master_client import MasterClient
from elastic_step.proto import elastic_pb2 as pb


def again(call, *args):
    """`call`, made again while its master cancels it (for a minute at most)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return call(*args)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main(address: str, index: int, think_s: float) -> int:
    client = MasterClient(address, os.environ[TOKEN_ENV], "worker", index)
    while True:
        minibatch = again(client.register).minibatch_size
        reply = again(client.get_task)
        if reply.kind == pb.GetTaskResponse.DONE:
            return 0
        if reply.kind == pb.GetTaskResponse.WAIT:
            time.sleep(reply.retry_after_s or 0.05)
            continue
        task, seq = reply.task, reply.task.start
        while seq < task.end:
            time.sleep(think_s)
            watermark = min(task.end, task.task_start + ((seq - task.task_start) // minibatch + 1) * minibatch)
            if again(client.report, task.task_id, watermark, watermark - seq, 0.0, False).stop:
                break  # the lease is no longer ours (a restarted master does not know it): ask again
            seq = watermark


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
