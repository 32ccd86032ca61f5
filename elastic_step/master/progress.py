"""Progress for people: a live line on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, mode: str, records_per_epoch: int, epochs: int, stream=None):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode = mode
        self.total = records_per_epoch * epochs
        self.epochs = epochs
        self._last_line = 0.0
        self._window: list[tuple[float, int]] = []

    def rate(self, records: int, now: float | None = None) -> float:
        """Records/s over the last ~5 s."""
        now = time.time() if now is None else now
        self._window.append((now, records))
        while len(self._window) > 2 and now - self._window[0][0] > 5.0:
            self._window.pop(0)
        (t0, r0), (t1, r1) = self._window[0], self._window[-1]
        return (r1 - r0) / (t1 - t0) if t1 > t0 else 0.0

    def show(self, sample: dict, final: bool = False, now: float | None = None) -> None:
        if self.mode == "off":
            return
        now = time.time() if now is None else now
        frac = min(1.0, sample["records"] / self.total) if self.total else 1.0
        loss = "-" if sample["loss"] is None else f"{sample['loss']:.4f}"
        text = (
            f"epoch {sample['epoch'] + 1}/{self.epochs} {frac * 100:5.1f}% "
            f"{sample['records']}/{self.total} records  {sample['records_per_s']:.0f} rec/s  "
            f"workers {sample['workers_alive']}  loss {loss}"
        )
        if self.mode == "bar":
            width = 24
            bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
            self.stream.write(f"\r[{bar}] {text}\033[K" + ("\n" if final else ""))
            self.stream.flush()
        elif final or now - self._last_line >= 5.0:
            self._last_line = now
            self.stream.write(f"progress: {text}\n")
            self.stream.flush()
