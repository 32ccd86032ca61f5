"""The worker: it leases record ranges from the master, trains on them and reports what it committed.

- `__main__.py`  the process: it runs one strategy, and reports an error as the user's or not.
- `ps/`  `--strategy ps`: asynchronous SGD against the parameter servers.
- `allreduce/`  `--strategy allreduce`: synchronous SGD over an elastic ring AllReduce.
- `finite.py`, `device.py`, `records.py`  what both strategies share: a minibatch that is not finite, the device
  trained on, and a minibatch's records as a user finds them.
"""
