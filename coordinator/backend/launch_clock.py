"""How long after `pdserve serve` was launched a start-up milestone came (Ray up, the coordinator started, the
workers requested, the workers ready): the server log's answer to "where did the start go" outside the workers'
own phases (pool_worker.start_phases).

The launch is the creation time of the `pdserve serve` process (Linux /proc; else the time `mark_launch` ran); its
children inherit it through the environment (PDSERVE_LAUNCHED_AT, wall-clock seconds).
"""

from __future__ import annotations

import os
import time

from pool_worker.start_phases import process_created_at

ENV = "PDSERVE_LAUNCHED_AT"


def mark_launch() -> None:
    """In the `pdserve serve` process, first: what its children measure from (kept where a parent set it)."""
    if ENV not in os.environ:
        os.environ[ENV] = repr(process_created_at() or time.time())


def since_launch() -> str:
    """'12.34 s after launch', or '' where no launch was marked (a coordinator started another way)."""
    try:
        return f"{time.time() - float(os.environ[ENV]):.2f} s after launch"
    except (KeyError, ValueError):
        return ""
