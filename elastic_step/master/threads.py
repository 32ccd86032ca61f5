"""How many threads each instance's TensorFlow runs on: the pools' environment the master gives a worker or a PS.

TensorFlow sizes its intra-op pool (the threads one op is split over) and its inter-op pool (ops run side by side)
by the cores it sees: every core of the machine, or of the node for a pod, whatever share the process may use. The
master sets both pools of each instance instead (docs/benchmarks.md has the measurements):

- **local backend, parameter servers**: 1 thread each. A shard's update is a few element-wise ops, and the default
  pools (one thread per core, spinning between ops) would take cores from the workers' steps.
- **local backend, workers**: an intra-op pool of `worker_threads`; 0 (automatic): the step's cores shared
  among the job's workers, cores // max_workers, at least 1 (measured, ps: a lone worker on 2 cores, 2 threads,
  the digits CNN's step 10 % faster than on 1, the MLP's no slower; allreduce: 2 workers on 2 cores, 1 thread
  each, the CNN's job 12 % faster than on TensorFlow's pools, the MLP's no slower). The inter-op pool (ops run
  side by side): 2 threads for a worker of 2 or more intra-op threads whose step is heavy, at least
  HEAVY_MINIBATCH multiply-adds a minibatch (a lone digits CNN worker, ~120 M: 8 % faster than on 1 in paired
  runs); else 1 (a small step is a chain of small ops, which a second thread only hands back and forth: the digits
  MLP's, ~1 M, 9 % slower on 2, twice as long on TensorFlow's default pools).
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
# A step of at least this many multiply-adds a minibatch (forward) gets a second inter-op thread. The two models
# measured lie 100-fold apart (digits MLP ~1 M, CNN ~120 M); this is between them, on the safe side of neither.
HEAVY_MINIBATCH = 10_000_000

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


def multiply_adds(model) -> int:
    """A Keras model's multiply-adds a record, forward, as its kernels tell: each kernel's size times the positions
    it is applied at (a Dense layer's 1, a convolution's output pixels), summed over its layers, nested models'
    included. A lower bound: what has no kernel (attention's products, pooling) counts nothing, a recurrent layer's
    steps and a layer whose output shape is not known count one position."""
    total = 0
    for layer in getattr(model, "layers", []):
        if hasattr(layer, "layers"):  # a nested model
            total += multiply_adds(layer)
            continue
        kernels = sum(math.prod(w.shape) for w in layer.weights if w.name.endswith("kernel"))
        if kernels:
            try:
                shape = tuple(layer.output.shape)
            except Exception:  # noqa: BLE001 - never called in a functional graph, or called more than once
                shape = ()
            positions = math.prod(d for d in shape[1:-1] if d) if len(shape) > 2 else 1
            total += int(kernels) * positions
    return total


def worker_inter_op(worker_intra: int | None, local: bool, minibatch_multiply_adds: int) -> int | None:
    """A worker's inter-op threads (module doc): on the local backend 2 for a heavy step on 2 or more intra-op
    threads, else 1; None (TensorFlow's own default) elsewhere."""
    if not local:
        return None
    return 2 if (worker_intra or 0) >= 2 and minibatch_multiply_adds >= HEAVY_MINIBATCH else 1


def pools_env(role: str, local: bool, worker_intra: int | None, worker_inter: int | None) -> dict[str, str]:
    """The TensorFlow pools' environment of an instance of `role` (worker or ps) of the job, on the local backend
    or not; `worker_intra`, `worker_inter`: a worker's intra-op and inter-op threads (worker_intra_op,
    worker_inter_op; None: TensorFlow's own default)."""
    if role != "worker":
        return dict(ONE_THREAD) if local else {}
    env = {INTER_OP_ENV: str(worker_inter)} if worker_inter is not None else {}
    return {**env, INTRA_OP_ENV: str(worker_intra)} if worker_intra is not None else env
