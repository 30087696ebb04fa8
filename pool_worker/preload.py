"""What a Ray worker process started ahead imports before Ray gives it an actor: torch and every module a worker's
start() imports (the engine, the transfer agents), so a worker started in such a process skips them.

Ray imports this module in each Python worker process it starts when its raylet runs with
`preload_python_modules: [pool_worker.preload]` (coordinator.backend.ray_start.init_ray sets that for a Ray that pdserve
starts; on a cluster, `RAY_preload_python_modules=pool_worker.preload` in `ray start`'s environment:
configs/cluster.yaml), and coordinator.backend.warm_processes keeps such processes ready on the workers' nodes.
Nothing here may start CUDA: the process learns its GPUs (CUDA_VISIBLE_DEVICES) only when Ray gives it an actor.
"""

import torch  # noqa: F401

import engine.llm_engine  # noqa: F401
import kvtransfer.worker_agents  # noqa: F401
import kvtransfer.worker_setup  # noqa: F401
import pool_worker.worker  # noqa: F401
