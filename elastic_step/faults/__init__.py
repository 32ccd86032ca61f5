"""Fault injection for tests, benchmarks and the demo: the chaos specs (chaos.py), which signal instances through
the backends, and a process's own faults (process.py). Both drive the runtime's hook points, which sit below
the runtime in elastic_step/fault_hooks.py: only the entry points that start a process import this package."""
