"""The worker of `--strategy ps`: asynchronous SGD against the parameter servers.

- process.py: the worker process of this strategy, wired from its command line;
- step.py: the step graph, compiled by a builder from the model and the placement alone;
- trainer.py: the trainer, which runs those steps on the shards' values and pushes what they return;
- loop.py: the task loop, which leases, reads, trains, pushes and reports, pipelined around one training thread.
"""
