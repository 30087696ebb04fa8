"""What a Ray worker process started ahead imports before Ray gives it an actor, for a server whose workers run no KV
agent (`mode: collocated`): torch and every module a worker's start() imports but the transfer agents'
(pool_worker.preload adds those: ucxx and cuda.core, ~0.7 s of imports on the 2-core machine, ~3x on an H200 host).

Ray imports it in each Python worker process it starts when its raylet runs with `preload_python_modules` naming it
(coordinator.backend.ray_start.init_ray sets that for a Ray that pdserve starts). Nothing here may start CUDA: the
process learns its GPUs (CUDA_VISIBLE_DEVICES) only when Ray gives it an actor. Nor is anything imported that a start
does not use: a `pdserve serve`'s first workers wait for this import (tests/test_start_imports.py).
"""

import gc

import torch  # noqa: F401 - the heaviest import of a start (3.3 s on an H200 host), made here first

import engine.llm_engine  # noqa: F401
import pool_worker.worker  # noqa: F401

# what this process holds now stays (the worker freezes its start-up objects too: engine.gc_pauses); frozen here,
# its own collection at start walks only what the start made
gc.collect()
gc.freeze()
