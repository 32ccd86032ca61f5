"""The elastic master: one for the length of a training step.

- `job.py`  the step's life: start, pump, end; `plan.py` what it decides at start; `api.py` its parameters.
- `service.py`  the gRPC service the workers and shards call.
- `leases/`  how a lease is granted: the coordinator's decisions under one lock, the ledger, the membership.
- `gray/`  what happens to a frozen worker, a silent shard and a straggler: watched, fenced, stopped, replaced.
- `durability/`  how a checkpoint is cut, where it is kept, and the audit that proves exactly-once.
- `relaunch.py`  what an instance's end leads to: relaunch, restore or fail.
- `timeline.py`, `failures.py`, `skipped.py`  what the job records and is told: its events, the failures
  reported, the minibatches skipped. They decide nothing.
- `observe/`  what the platform sees: /metrics, the goodput, Kubernetes Events.
"""
