"""Leases: how a lease is granted, and who may hold one.

- `coordinator.py`  the decisions, under one lock: a worker asks for work (`get_task`), and gets a lease, a
  wait (a checkpoint's barrier, a rewind, fewer than min_workers) or the end; its reports commit; a loss
  requeues the remainder of its lease at once.
- `ledger.py`  the leases themselves: the queue of tasks, each lease's watermark, what is committed, and the
  hand-over of a straggler's tail. Plain data, deterministic.
- `membership.py`  which instances exist and in what state (from backend events and calls).
- `rendezvous.py`  allreduce: the ring's versioned membership, where a step commits every member's watermark
  at once.
"""
