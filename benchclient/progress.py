"""A one-line progress bar on stderr for a load run: time (or requests) done, sent, finished, failed, in flight.

Owns only drawing; the driver bumps the counters. Off (draws nothing) when `enabled` is False, e.g. in tests.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

WIDTH = 30


class Progress:
    def __init__(self, horizon_s: float | None, total_requests: int | None, enabled: bool = True,
                 stream: TextIO | None = None) -> None:
        self.horizon_s = horizon_s
        self.total_requests = total_requests
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self.sent = self.done = self.failed = 0
        self.draining = False

    def line(self) -> str:
        elapsed = time.perf_counter() - self.t0
        if self.horizon_s:
            frac, what = min(1.0, elapsed / self.horizon_s), f"{elapsed:6.1f}/{self.horizon_s:.0f} s"
        else:
            total = self.total_requests or 1
            frac, what = min(1.0, self.done / total), f"{elapsed:6.1f} s"
        bar = "#" * int(frac * WIDTH) + "." * (WIDTH - int(frac * WIDTH))
        state = "  draining" if self.draining else ""
        return (f"\r[{bar}] {what}  sent {self.sent}  done {self.done}  failed {self.failed}  "
                f"in flight {self.sent - self.done}{state}  ")

    def draw(self) -> None:
        if self.enabled:
            self.stream.write(self.line())
            self.stream.flush()

    async def tick_forever(self, every_s: float = 0.25) -> None:
        while True:
            self.draw()
            await asyncio.sleep(every_s)

    def close(self) -> None:
        if self.enabled:
            self.draw()
            self.stream.write("\n")
            self.stream.flush()
