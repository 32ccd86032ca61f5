"""A test model made slower in its worker processes: each feed() there sleeps, as a model whose steps take longer.

The sleep is in feed(), which a worker calls once per lease (or per minibatch), and only in a worker's process
(the master's own calls, for evaluation, do not sleep), so every member is slowed alike: no one is a straggler.
"""

from __future__ import annotations

import os
import textwrap

PACED = """
import os as _os
import time as _time

from elastic_step.util.process import PARENT_ENV as _PARENT_ENV


def feed(batch):
    global _started
    if _os.environ.get(_PARENT_ENV):
        _time.sleep(STEP_S if globals().get("_started") else FIRST_STEP_S)
        _started = True
    return _paced_feed(batch)
"""


def paced_model(model_path: str, out_dir, step_s: float, first_step_s: float | None = None) -> str:
    """A copy of the model at `model_path`, written into `out_dir`, whose feed() in a worker sleeps `step_s`, and
    `first_step_s` (default `step_s`) the first time, as a first step that traces for long."""
    path = out_dir / f"paced_{os.path.basename(model_path)}"
    source = open(model_path).read().replace("def feed(", "def _paced_feed(")
    first = step_s if first_step_s is None else first_step_s
    path.write_text(source + textwrap.dedent(PACED) + f"\nSTEP_S = {step_s}\nFIRST_STEP_S = {first}\n")
    return str(path)
