"""What a Ray worker process started ahead imports before Ray gives it an actor: torch and every module a worker's
start() imports (the engine, the transfer agents), so a worker started in such a process skips them.

Ray imports this module in each Python worker process it starts when its raylet runs with
`preload_python_modules: [pool_worker.preload]` (coordinator.backend.ray_start.init_ray sets that for a Ray that pdserve
starts; on a cluster, `RAY_preload_python_modules=pool_worker.preload` in `ray start`'s environment:
configs/cluster.yaml), and coordinator.backend.warm_processes keeps such processes ready on the workers' nodes.
Nothing here may start CUDA: the process learns its GPUs (CUDA_VISIBLE_DEVICES) only when Ray gives it an actor.
"""

import contextlib
import gc

import torch

import engine.llm_engine  # noqa: F401
import kvtransfer.worker_agents  # noqa: F401
import kvtransfer.worker_setup  # noqa: F401
import pool_worker.worker  # noqa: F401

# torch imports sympy (its symbolic shapes) on the first Module.to_empty, which the engine's weight load makes: ~0.2 s
# of a start on the CPU machine, paid here instead (a meta module made real on the CPU: no device is touched)
torch.nn.Linear(1, 1, device="meta").to_empty(device="cpu")

# ucxx's progress thread imports cuda.core as it starts (ucxx._cuda_context, with the worker's first KV agent), and the
# agent's start waited for it: ~0.05 s of `ucx_listen` on the CPU machine (kvtransfer.agent's start steps), paid here.
# The import loads no CUDA driver (it succeeds on a host without one); a ucxx without it has nothing to pay
with contextlib.suppress(ImportError):
    import cuda.core  # noqa: F401

# what this process holds now stays (the worker freezes its start-up objects too: engine.gc_pauses); frozen here,
# its own collection at start walks only what the start made
gc.collect()
gc.freeze()
