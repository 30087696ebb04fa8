"""The garbage collector in a pool worker's process: its start-up objects frozen, its pauses counted.

`freeze_startup_objects()` runs once start-up is done (rank 0's worker and every TP follower).
GcPauses reports the pauses that remain, for the worker's load report.

A collection runs under the GIL: while it does, the engine's step thread and the worker's event loop both wait, so
every request in flight there stalls. The callback (gc.callbacks) times each collection from start to stop and
counts the full ones (generation 2, which walk every tracked object not frozen at start-up). A worker installs one
for its process's life; its figures go out with every EngineLoad it reports (`gc_*` fields).
"""

from __future__ import annotations

import gc
import time


class GcPauses:
    def __init__(self) -> None:
        self.pauses = 0          # collections of any generation
        self.full = 0            # of those, generation 2
        self.seconds = 0.0       # summed pause
        self.max_s = 0.0         # the longest pause
        self._started: float | None = None

    def install(self) -> None:
        gc.callbacks.append(self._on_gc)

    def remove(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def figures(self) -> dict[str, float]:
        return {"gc_pauses_total": self.pauses, "gc_full_collections_total": self.full,
                "gc_pause_seconds_total": self.seconds, "gc_pause_max_s": self.max_s}

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed during a collection
            return
        pause, self._started = time.perf_counter() - self._started, None
        self.pauses += 1
        self.seconds += pause
        self.max_s = max(self.max_s, pause)
        if info.get("generation") == 2:
            self.full += 1


def freeze_startup_objects() -> None:
    """For a pool worker at the end of its start-up: what start-up built (torch, Ray, Triton, the model, its graphs:
    ~0.3 M objects with `tiny` on the CPU, more on a GPU) lives as long as the process, and a full collection over it
    (~0.1 s on the 2-core machine) stalls the step thread under the GIL, a latency spike for every request in flight.
    Freezing it keeps it out of every later collection, as the coordinator does (coordinator.serve) and vLLM's engine
    core after start-up. LLMEngine.close() and a follower's teardown unfreeze before the collection they need."""
    gc.collect()
    gc.freeze()
