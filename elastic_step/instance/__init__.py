"""What every instance (a worker or a PS shard) shares, below both roles: the contract the master starts and
ends it by (api.py), how its process starts (startup.py), and its clients of the master (master_client.py) and of
an allreduce member (collective_client.py)."""
