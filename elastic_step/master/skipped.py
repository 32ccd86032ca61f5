"""--skip-non-finite: the minibatches workers skipped, each counted once, for summary.json."""

from __future__ import annotations

import logging
import threading

from elastic_step.master.timeline import Timeline

log = logging.getLogger("elastic_step.master")


class SkippedMinibatches:
    def __init__(self, timeline: Timeline):
        self._lock = threading.Lock()
        self.timeline = timeline
        self.skipped: dict[tuple[int, int, int, int], dict] = {}  # by (epoch, data shard, start, end)

    def skip(self, worker: str, epoch: int, data_shard: int, shard: str, start: int, end: int, why: str, step: int):
        """`worker` skipped records [start, end) of a data shard in `epoch` (allreduce: in `step`). Counted once,
        whoever skipped it again (a successor of a lost worker, a step retried)."""
        key = (epoch, data_shard, start, end)
        at = f"records [{start}, {end}) of {shard} in epoch {epoch + 1}" + (f", step {step}" if step >= 0 else "")
        with self._lock:
            if key in self.skipped:
                return
            self.skipped[key] = {
                "worker": worker,
                "epoch": epoch,
                "data_shard": shard,
                "start": start,
                "end": end,
                **({"step": step} if step >= 0 else {}),
                "why": why,
            }
            self.timeline.record("skipped", worker, f"{at}: {why}")
        log.warning("%s skipped %s: %s (--skip-non-finite)", worker, at, why)

    def summary(self) -> dict:
        """summary.json's account of the skipped minibatches."""
        with self._lock:
            listed = sorted(self.skipped.values(), key=lambda s: (s["epoch"], s["data_shard"], s["start"]))
        return {"minibatches": len(listed), "records": sum(s["end"] - s["start"] for s in listed), "skipped": listed}
