"""What a Ray worker process started ahead imports before Ray gives it an actor: torch and every module a worker's
start() imports (the engine, pool_worker.preload_engine's, and the transfer agents), so a worker started in such a
process skips them.

Ray imports this module in each Python worker process it starts when its raylet runs with
`preload_python_modules: [pool_worker.preload]` (coordinator.backend.ray_start.init_ray sets that for a Ray that pdserve
starts whose workers hand KV over; a collocated server's preloads pool_worker.preload_engine; on a cluster,
`RAY_preload_python_modules=pool_worker.preload` in `ray start`'s environment: configs/cluster.yaml), and
coordinator.backend.warm_processes keeps such processes ready on the workers' nodes.
Nothing here may start CUDA: the process learns its GPUs (CUDA_VISIBLE_DEVICES) only when Ray gives it an actor.
Nor is anything imported that a start does not use: a `pdserve serve`'s first workers wait for this import (on an
H200 host it took 7.4-8.9 s, sympy 2.2 s of it until the engine stopped importing that: tests/test_start_imports.py).
"""

import contextlib
import gc

import kvtransfer.worker_agents  # noqa: F401
import kvtransfer.worker_setup  # noqa: F401
import pool_worker.preload_engine  # noqa: F401

# ucxx's progress thread imports cuda.core as it starts (ucxx._cuda_context, with the worker's first KV agent), and the
# agent's start waited for it: ~0.05 s of `ucx_listen` on the CPU machine (kvtransfer.agent's start steps), paid here.
# The import loads no CUDA driver (it succeeds on a host without one); a ucxx without it has nothing to pay
with contextlib.suppress(ImportError):
    import cuda.core  # noqa: F401

gc.collect()
gc.freeze()  # as pool_worker.preload_engine does, for what the transfer agents' modules added
