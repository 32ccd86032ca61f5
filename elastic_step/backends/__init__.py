"""The backends: they start and stop the job's instances and stream their events to the master.

- `api.py`  the contract: an instance's id and spec, its events, the Backend interface.
- `local.py`  every instance a process of this step; `preloaded.py` forks them from one TensorFlow import.
- `kubernetes/`  every instance a pod in the step's namespace.
"""
