"""The worker of `--strategy allreduce`: synchronous SGD over an elastic ring AllReduce.

- process.py: the worker process of this strategy, wired from its command line;
- member.py: a member of the master's membership, which trains runs of steps and commits them atomically;
- trainer.py: the model, the user's optimizer and the state a run is applied beyond and goes back to;
- step.py: the member's step graph, compiled by a builder from the model and its optimizer alone;
- collective.py: the ring AllReduce and the member's Collective service (its client: instance/collective_client.py),
  over ring_transport.py (TCP), ring_lane.py (shared memory between neighbours on one host) and ring_result.py
  (one shared result when every link is a lane).
"""
