"""DeferredGraphs: the CUDA graphs an engine captures once it serves (EngineConfig.graph_capture "deferred"), and
when it captures them.

At start an engine captures only its first decode buckets (engine.runner.rank_setup.FIRST_DECODE_BUCKETS), so it is
ready seconds sooner; a decode step that needs a larger bucket captures it first (DecodeGraphs.ensure). Everything
else is captured here, one graph set's bucket per call, between two steps on the engine thread: the decode buckets
smallest first (the batches a growing load meets next), then the prefill-only buckets, then the mixed-step ones.
Until its graph exists a step runs in a larger captured bucket, or eagerly: the same math, only slower.
Policy: an idle engine captures back to back (one bucket per idle turn, so an arriving request waits at most one
capture); a busy one at most one capture after each stretch of steps BUSY_SPACING times as long as the last
capture took (the captures then cost the running streams at most 1 / BUSY_SPACING of their steps).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

log = logging.getLogger(__name__)

BUSY_SPACING = 20


class _Pending(Protocol):
    def capture_pending(self) -> bool: ...


class DeferredGraphs:
    def __init__(self, graph_sets: list[_Pending | None]) -> None:
        """`graph_sets`: DecodeGraphs, PrefillGraphs, MixedGraphs (None: a set the engine does not have), in the
        order they are captured."""
        self.sets = [g for g in graph_sets if g is not None and g.deferred.pending]
        self.seconds = 0.0     # spent capturing here so far (a decode bucket a step needed is not counted)
        self.captured = 0
        self._next_busy = 0.0  # time.monotonic() before which a busy engine captures nothing

    @property
    def left(self) -> int:
        """Buckets still to capture (decode buckets included, whoever captures them)."""
        return sum(len(g.deferred.pending) for g in self.sets)

    def capture_one(self, busy: bool) -> bool:
        """Capture one pending bucket unless none is left or, when `busy`, the last capture was too recent.
        Returns whether it captured one."""
        now = time.monotonic()
        if (busy and now < self._next_busy) or not self.sets:
            return False
        while self.sets and not self.sets[0].deferred.pending:
            self.sets.pop(0)
        if not self.sets:
            return False
        self.sets[0].capture_pending()
        took = time.monotonic() - now
        self.seconds += took
        self.captured += 1
        self._next_busy = now + took * (1 + BUSY_SPACING)
        if not self.left:
            log.info("deferred CUDA graphs: %d buckets captured while serving, %.2f s", self.captured, self.seconds)
        return True
