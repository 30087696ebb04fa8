"""How long each phase of a worker's start took, measured in the worker's own process.

The phases, in order, in seconds (WorkerInfo.startup_s; /health's `start_phases_s` and
`pdserve_worker_start_seconds{phase}`, coordinator.backend.start_report):
- `schedule`: from the coordinator's request for the actor to the creation of the process that hosts it (0 when Ray
  handed over a worker process it had started ahead: coordinator.backend.warm_processes);
- `process`: from then until the worker's code began to import (the interpreter and Ray's worker bootstrap; 0 in a
  process that imported it ahead, pool_worker.preload);
- `handover`, only in a process started ahead: from the request until the actor began in it (Ray's handover, and
  the wait for the process's own start and preload where the request came before they were done);
- `imports`: the worker's code and what its start needs (torch, the engine, the transfer agents); in a process that
  imported them ahead, only what was left;
- `engine_<phase>`: the engine's own (engine.llm_engine: config, weights, kv_cache, cuda_graphs, prefill_graphs,
  mixed_graphs, warmup);
- `agent`: the transfer agents and the rest of start(), until the worker can be routed to;
then, once it is routable, in the background: `grammar` (the structured-output tables: EngineLoad.grammar_load_s)
and `graphs` (the CUDA graphs left for after start, captured between steps: EngineLoad.graph_capture_s).
Within the process each phase is a difference of time.monotonic(); the first two begin in another process, so they
compare wall clocks (the coordinator's and this host's: across hosts, as right as the clocks agree).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# when this process began importing the worker's code (pool_worker/__init__ imports this module first): wall, monotonic
IMPORT_STARTED = (time.time(), time.monotonic())


def process_created_at() -> float | None:
    """The wall-clock time this process was created (Linux: /proc/self/stat's start time), None where unknown."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime: clock ticks after boot (fields[0] is field 3)
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - age


def before_start(requested_at: float | None) -> list[tuple[str, float]]:
    """`schedule` and `process` (see above) for an actor requested at wall time `requested_at`; none where the
    request's time or the process's creation is unknown."""
    created = process_created_at()
    if requested_at is None or created is None:
        return []
    began = max(created, requested_at)  # a process started ahead was idle until the request
    phases = [("schedule", round(max(0.0, created - requested_at), 3)),
              ("process", round(max(0.0, IMPORT_STARTED[0] - began), 3))]
    if created < requested_at:
        phases.append(("handover", round(max(0.0, time.time() - requested_at), 3)))
    return phases


def imports_began(requested_at: float | None) -> float:
    """The monotonic time the `imports` phase began: when the worker code began to import, or, in a process that
    imported it ahead (pool_worker.preload, before the actor was requested at wall time `requested_at`), now: what
    start() imports then is what the preload left out."""
    if requested_at is not None and IMPORT_STARTED[0] < requested_at:
        return time.monotonic()
    return IMPORT_STARTED[1]


def imports_done(began: float) -> tuple[str, float]:
    """`imports`: from `began` (imports_began) until now."""
    return "imports", round(time.monotonic() - began, 3)
