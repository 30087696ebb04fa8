"""Setting up a pool worker's process for KV transfer: the steps every worker takes, in the order they must run.

1. `prepare_process(device, config)` before CUDA starts: in a Ray actor on CUDA that may use cuda_ipc, show
   the peers' GPUs (ours stays cuda:0).
2. `begin_agent(name, config)` (optional) right after it: the agent itself (its loop thread, UCX's context and
   listeners: nothing needs the cache) made on a thread of its own, beside the engine's load; on an H200 UCX's context
   took ~0.76 s of a 1B worker's start, after the engine. Hand the future to step 3, or to `discard_agent`.
3. `start_agent(name, config, kv, spec, heads, ahead)` once the engine's cache exists: ucxx Python futures (one
   agent in this process, so no busy-polling while idle) and the network devices the config names, then the agent
   (made ahead, or now) with the cache registered (a TP rank's cache with the global KV heads it holds,
   engine.kv_heads; None: all heads).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

import torch

from engine.kv_heads import KVHeadRange
from engine.kv_layout import KVCacheSpec

from .agent import AgentConfig, KVAgent
from .backends.ucx import use_python_futures
from .gpu_visibility import expose_peer_gpus, node_gpus, uses_cuda_ipc


def prepare_process(device: str, config: AgentConfig | None) -> None:
    if device.startswith("cuda") and uses_cuda_ipc(config):
        expose_peer_gpus(node_gpus())


def begin_agent(name: str, config: AgentConfig) -> Future:
    """Step 2: Future[KVAgent] of an agent being made on a thread (its loop thread makes UCX's context, which binds
    to that loop); the future holds the error its making raised, as step 3 would have raised it."""
    _ucx_environment(config)
    made: Future = Future()

    def make() -> None:
        try:
            made.set_result(KVAgent(name, config))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the agent
            made.set_exception(e)
    threading.Thread(target=make, name=f"agent-start-{name}", daemon=True).start()
    return made


def discard_agent(ahead: Future) -> None:
    """An agent made ahead that will never get a cache (the worker's start failed): closed once it is made."""
    ahead.add_done_callback(lambda f: f.exception() is None and f.result().close())


def _ucx_environment(config: AgentConfig) -> None:
    use_python_futures()
    if config.net_devices is not None:  # read once, when this process's UCX context is made
        os.environ["UCX_NET_DEVICES"] = config.net_devices


def start_agent(name: str, config: AgentConfig, kv: torch.Tensor, spec: KVCacheSpec,
                heads: KVHeadRange | None = None, ahead: Future | None = None) -> KVAgent:
    """kv: the engine's cache [num_blocks, num_layers, 2, block_size, kv_heads, head_dim] holding `heads`.
    `ahead`: begin_agent's future for this agent (None: made here)."""
    _ucx_environment(config)
    agent = ahead.result() if ahead is not None else KVAgent(name, config)
    agent.register_cache(kv, spec, heads)
    return agent
