"""Setting up a pool worker's process for KV transfer: the steps every worker takes, in the order they must run.

1. `prepare_process(device, config)` before CUDA starts: in a Ray actor on CUDA that may use cuda_ipc, show
   the peers' GPUs (ours stays cuda:0).
2. `start_agent(name, config, kv, spec, heads)` once the engine's cache exists: ucxx Python futures (one agent in
   this process, so no busy-polling while idle) and the network devices the config names, then the agent with the
   cache registered (a TP rank's cache with the global KV heads it holds, engine.kv_heads; None: all heads).
"""

from __future__ import annotations

import os

import torch

from engine.kv_heads import KVHeadRange
from engine.kv_layout import KVCacheSpec

from .agent import AgentConfig, KVAgent
from .backends.ucx import use_python_futures
from .gpu_visibility import expose_peer_gpus, node_gpus, uses_cuda_ipc


def prepare_process(device: str, config: AgentConfig | None) -> None:
    if device.startswith("cuda") and uses_cuda_ipc(config):
        expose_peer_gpus(node_gpus())


def start_agent(name: str, config: AgentConfig, kv: torch.Tensor, spec: KVCacheSpec,
                heads: KVHeadRange | None = None) -> KVAgent:
    """kv: the engine's cache [num_blocks, num_layers, 2, block_size, kv_heads, head_dim] holding `heads`."""
    use_python_futures()
    if config.net_devices is not None:  # read once, when the agent creates this process's UCX context
        os.environ["UCX_NET_DEVICES"] = config.net_devices
    agent = KVAgent(name, config)
    agent.register_cache(kv, spec, heads)
    return agent
