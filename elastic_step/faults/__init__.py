"""Fault injection for tests, benchmarks and the demo: the runtime's hook points (api.py) and the chaos specs that
drive them (chaos.py)."""
