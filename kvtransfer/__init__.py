"""kvtransfer: moves paged KV-cache blocks between workers (prefill -> decode), NIXL-style, over UCX.

Public API: `KVAgent` (+ `AgentConfig`), `AgentMetadata`, `TransferHandle` / `TransferState`, the errors,
and `LayerStreamer` for layer-wise pushes. Depends on `engine.kv_layout`; nothing in engine imports this.
"""

from .agent import AgentConfig, KVAgent
from .errors import (
    BadDescriptor,
    IncompatibleLayout,
    PeerLost,
    RemoteError,
    TransferError,
    TransferTimeout,
)
from .handle import TransferHandle, TransferState
from .metadata import AgentMetadata, CacheInfo
from .streaming import LayerStreamer

__all__ = [
    "AgentConfig",
    "AgentMetadata",
    "BadDescriptor",
    "CacheInfo",
    "IncompatibleLayout",
    "KVAgent",
    "LayerStreamer",
    "PeerLost",
    "RemoteError",
    "TransferError",
    "TransferHandle",
    "TransferState",
    "TransferTimeout",
]
