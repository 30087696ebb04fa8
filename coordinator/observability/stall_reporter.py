"""StallReporter: what an event loop was running when it stalled (`server.stall_report_ms`; off by default).

LoopLag counts the loop's stalls; this says where the loop was, like a `py-spy dump` taken at the right moment. A
heartbeat on the loop stamps the time every threshold / 4; a daemon thread looks at the stamp as often and, once it
is older than the threshold, logs the loop thread's Python stack (once per stall, with how long the loop had been
stuck by then) and every other thread's innermost frame on the `pdserve.stalls` logger. A loop found in its
selector was not busy: its thread waited for a CPU or for the GIL, which another thread held. The reporter needs
the GIL to read the stacks: a stall inside C code that holds the GIL is seen when the code releases it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.config.settings import ServerSettings

log = logging.getLogger("pdserve.stalls")
IDLE = "it is back from waiting for events, so it waited for the CPU or for the GIL (see the other threads):"


class StallReporter:
    def __init__(self, threshold_s: float, name: str) -> None:
        self.threshold_s, self.name = threshold_s, name
        self.reports = 0
        self._beat = time.monotonic()
        self._handle: asyncio.TimerHandle | None = None
        self._stopped = threading.Event()
        self._loop_thread = 0

    def start(self) -> None:
        """Watch the running loop (call on it)."""
        self._loop_thread = threading.get_ident()
        self._tick(asyncio.get_running_loop())
        threading.Thread(target=self._watch, name=f"stall-reporter ({self.name})", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        if self._handle is not None:
            self._handle.cancel()

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._beat = time.monotonic()
        self._handle = loop.call_later(self.threshold_s / 4, self._tick, loop)

    def _watch(self) -> None:
        reported = None  # the heartbeat whose stall was reported already
        while not self._stopped.wait(self.threshold_s / 4):
            beat = self._beat
            stalled_s = time.monotonic() - beat
            if stalled_s < self.threshold_s or beat == reported:
                continue
            frames = sys._current_frames()
            frame = frames.get(self._loop_thread)
            if frame is None:
                continue
            reported = beat
            self.reports += 1
            waiting = frame.f_code.co_name in ("select", "poll") and "selectors" in frame.f_code.co_filename
            names = {t.ident: t.name for t in threading.enumerate()}
            others = [f"  {names.get(ident, ident)}: {f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}"
                      for ident, f in frames.items() if ident not in (self._loop_thread, threading.get_ident())]
            log.warning("%s: event loop stalled for %.1f ms so far; %s\n%s\nother threads, innermost frame:\n%s",
                        self.name, 1e3 * stalled_s, IDLE if waiting else "it is running:",
                        "".join(traceback.format_stack(frame)).rstrip(), "\n".join(others) or "  (none)")


def start_stall_reporter(settings: ServerSettings, name: str) -> StallReporter | None:
    """The running loop's StallReporter when `server.stall_report_ms` is set (started), else None."""
    if not settings.stall_report_ms:
        return None
    reporter = StallReporter(settings.stall_report_ms / 1000, name)
    reporter.start()
    return reporter
