"""Self-healing's settings (`recovery:`; coordinator.backend.supervisor): how dead workers are replaced (restarts,
backoff, warm spares), how often a request may move off a dead worker, the fallback to one pool, the retry of a
failed prefill, and how often `pdserve serve` restarts a crashed coordinator.

    recovery: {max_restarts: 5, restart_window_s: 600, max_migrations: 3, fallback: true, prefill_retry: true,
               spares: 1}
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SPARES = 64
MAX_WARM_PROCESSES = 16


@dataclass(frozen=True)
class RecoveryConfig:
    """Self-healing: replacing dead workers (with backoff) and moving their requests elsewhere."""

    max_restarts: int = 5            # per worker slot within restart_window_s; past it the slot stays down
    restart_window_s: float = 600.0
    backoff_initial_s: float = 0.5   # a worker slot's 2nd replacement in restart_window_s waits this (the 1st:
    # none), doubling per further one; a crashed coordinator's restart waits it the first time
    backoff_max_s: float = 30.0
    max_migrations: int = 3          # per request: moves to another worker after a worker or transfer failure
    # disaggregated: while one pool has no live worker, requests (new and moved) run whole on the other pool's workers
    fallback: bool = True
    # a prompt whose prefill failed on its prefill worker (an error there: its death moves the request anyway) runs
    # whole on a decode worker, once (counted as a move); false: the request fails (502 naming the error)
    prefill_retry: bool = True
    spares: int = 0                  # warm spare workers per pool (model loaded, not routed to); take over a dead slot
    # Ray worker processes kept started ahead (pdserve's worker modules imported) on each node with workers, for the
    # next worker start there (coordinator.backend.warm_processes); 0: none
    warm_processes: int = 1
    # coordinator crashes `pdserve serve` restarts it after within restart_window_s (with the backoff above); it
    # adopts the running workers (coordinator.process_supervisor). 0: a crashed coordinator ends the server
    coordinator_max_restarts: int = 5

    def __post_init__(self) -> None:
        if not 0 <= self.spares <= MAX_SPARES:
            raise ValueError(f"spares must be in [0, {MAX_SPARES}] (warm spare workers per pool), got {self.spares}")
        if not 0 <= self.warm_processes <= MAX_WARM_PROCESSES:
            raise ValueError(f"warm_processes must be in [0, {MAX_WARM_PROCESSES}] (worker processes started ahead "
                             f"per node), got {self.warm_processes}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(f"backoff_max_s ({self.backoff_max_s}) must be >= backoff_initial_s "
                             f"({self.backoff_initial_s})")

