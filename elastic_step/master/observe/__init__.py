"""What the platform sees of a running step: its metrics and its goodput, live.

- `goodput.py`  where the step's wall time and worker-seconds go: training that counted, or a cause of loss.
- `metrics.py`  `GET /metrics` (Prometheus): a per-job registry whose collector reads the master's state when
  scraped, and the few histograms the service feeds as calls are served.
- `notices.py`  the master's timeline as Kubernetes Events on the step's own pod (through the backend).
"""
