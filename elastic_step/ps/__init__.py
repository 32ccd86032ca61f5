"""The parameter servers: each shard holds its share of the variables and the optimizer's state, and applies each
keyed push at most once.

- `api.py`  the contract: where each parameter lives (the placement), a push's key.
- `server.py`  a shard and its gRPC service; `shard_graph.py` its variables and update graph; `__main__.py` its
  process.
- `client.py`  the workers' and the master's client of every shard; `push_slots.py` and `doorbell.py` a push
  in shared memory, for a worker on the shard's host.
"""
