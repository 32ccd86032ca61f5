"""Durability: how a checkpoint is cut, where it is kept, and the audit that proves exactly-once.

- `checkpoint.py`  when a checkpoint is cut (the barrier: workers finish their pushes and hold, the state and
  the ledger are taken at one cut), and what a resumed job, a lost PS or a ring that lost every member goes
  back to.
- `store.py`  where checkpoints live and their layout: the part files first, then one manifest, the commit
  point; the job's fingerprint, so that another job's checkpoint is never resumed.
- `audit.py`  what the model's state says it applied, laid over the training data (not over the ledger): per
  epoch, every record applied exactly once.
"""
