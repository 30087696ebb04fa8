"""Joining or starting the Ray cluster the pools run on (`init_ray`), and what a Ray that pdserve starts is set up
with (worker processes that import pdserve's worker modules ahead)."""

from __future__ import annotations

import os

import ray

from coordinator.backend.early_prestart import EarlyPrestart

FORWARDED_ENV = ("PDSERVE_CACHE", "PDSERVE_PDL")  # the workers' copy of the environment settings that reach them


def init_ray(address: str | None, namespace: str | None = None, transfers: bool = True,
             prestart: int = 0) -> bool:
    """Join `address` ("auto": the running cluster) or start a local Ray. A local start waits a fixed 30 s
    for its raylet; on a loaded machine that can run out, so a local start is tried twice. `transfers`: the workers
    hand KV over to each other (not collocated), so the worker processes a local Ray starts import the transfer
    agents ahead too (pool_worker.preload; else pool_worker.preload_engine). `prestart`: a local Ray's raylet is
    asked for that many worker processes as soon as it registers (coordinator.backend.early_prestart). Returns
    whether it was: if not, the caller asks now that Ray is up (coordinator.backend.warm_processes)."""
    env = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
    # a local Ray's workers inherit this process's environment; a runtime_env would add ~1 s to the start
    runtime_env = {"env_vars": env} if env and address is not None else None
    # a Ray started here: its worker processes import pdserve's worker modules ahead (`preload`), and it
    # starts none ahead for its first driver (one per CPU: coordinator.backend.warm_processes starts what is used)
    preload = "pool_worker.preload" if transfers else "pool_worker.preload_engine"
    system = None if address is not None else {"preload_python_modules": [preload],
                                               "prestart_worker_first_driver": False}
    early = EarlyPrestart(prestart) if address is None and prestart > 0 else None
    if early is not None:
        early.start()
    attempts = 0
    try:
        for attempt in (1, 2):
            attempts = attempt
            try:
                ray.init(address=address, include_dashboard=False, logging_level="WARNING",
                         runtime_env=runtime_env, namespace=namespace, _system_config=system)
                break
            except Exception as e:  # Ray raises a bare Exception for this
                if address is not None or attempt == 2 or "timed out during startup" not in str(e):
                    raise
                ray.shutdown()
    finally:
        sent = early is not None and early.finish()
    return sent and attempts == 1  # after a retry, the raylet asked may have been the first try's
