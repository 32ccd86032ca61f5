"""How many threads each instance's TensorFlow runs on: the pools' environment the master gives a worker or a PS.

TensorFlow sizes its intra-op pool (the threads one op is split over) and its inter-op pool (ops run side by side)
by the cores it sees: every core of the machine, or of the node for a pod, whatever share the process may use. The
master sets both pools of each instance instead (docs/benchmarks.md has the measurements):

- **local backend, parameter servers**: 1 thread each. A shard's update is a few element-wise ops, and the default
  pools (one thread per core, spinning between ops) would take cores from the workers' steps.
- **local backend, workers**: an intra-op pool of `worker_threads`; 0 (automatic): the step's cores shared
  among the job's workers, cores // max_workers, at least 1 (measured, ps: a lone worker on 2 cores, 2 threads,
  the digits CNN's step 10 % faster than on 1, the MLP's no slower; allreduce: 2 workers on 2 cores, 1 thread
  each, the CNN's job 12 % faster than on TensorFlow's pools, the MLP's no slower). The inter-op pool: 1 (a
  worker's step is one compiled call, mostly a chain of ops; with the default pools the digits MLP's ps step took
  twice as long, and 2 inter-op threads, which sped the CNN up, slowed the MLP down by 10-23 %).
- **Kubernetes, workers**: an intra-op pool of `worker_threads`; 0: the pod's own CPU (`worker_cpu`, rounded up),
  when it has one, as TensorFlow would otherwise run a pool of the node's cores on a pod's share of them.
- the PS pods as TensorFlow sizes them.
"""

from __future__ import annotations

import math
import re

INTRA_OP_ENV = "TF_NUM_INTRAOP_THREADS"
INTER_OP_ENV = "TF_NUM_INTEROP_THREADS"
ONE_THREAD = {INTRA_OP_ENV: "1", INTER_OP_ENV: "1"}

_CPU = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(m|[eE][+-]?\d+)?")  # the CPU quantities a worker_cpu takes: 2, 1.5, 1500m


def cpu_cores(quantity: str) -> int | None:
    """A Kubernetes CPU quantity in whole cores, rounded up ("1500m" -> 2, "2" -> 2, "250m" -> 1); None when
    there is none (empty: no limit) or it is not a plain number of cores or millicores."""
    m = _CPU.fullmatch(quantity.strip())
    if m is None:
        return None
    number, suffix = float(m.group(1)), m.group(2) or ""
    cores = number / 1000 if suffix == "m" else number * 10 ** int(suffix[1:]) if suffix else number
    return max(1, math.ceil(cores - 1e-9)) if cores > 0 else None


def worker_intra_op(
    worker_threads: int, backend: str, strategy: str, max_workers: int, cores: int, worker_cpu: str
) -> int | None:
    """A worker's intra-op threads: `worker_threads` when given (>= 1), else the automatic rule (module doc);
    None: TensorFlow's own default."""
    if worker_threads > 0:
        return worker_threads
    if backend == "local":
        return max(1, cores // max(1, max_workers))  # either strategy
    return cpu_cores(worker_cpu) if worker_cpu else None


def pools_env(role: str, local: bool, worker_intra: int | None) -> dict[str, str]:
    """The TensorFlow pools' environment of an instance of `role` (worker or ps) of the job, on the local backend
    or not; `worker_intra`: a worker's intra-op threads (worker_intra_op; None: TensorFlow's own default)."""
    if role != "worker":
        return dict(ONE_THREAD) if local else {}
    env = {INTER_OP_ENV: "1"} if local else {}
    return {**env, INTRA_OP_ENV: str(worker_intra)} if worker_intra is not None else env
