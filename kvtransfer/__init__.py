"""kvtransfer: moves paged KV-cache blocks between workers (prefill -> decode), NIXL-style, over UCX.

Public API: `KVAgent` (+ `AgentConfig`), `AgentMetadata`, `GroupMetadata` and `read_from_group` (TP groups),
`TransferHandle` / `TransferState`, the errors, `LayerStreamer` for layer-wise pushes, and `FaultConfig` (injected
faults; env `PDSERVE_KV_FAULTS`). Depends on `engine.kv_layout`; nothing in engine imports this.
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
from .faults import ENV_VAR as FAULTS_ENV_VAR
from .faults import FaultConfig
from .handle import TransferHandle, TransferState
from .metadata import AgentMetadata, CacheInfo
from .streaming import LayerStreamer
from .tp_group import GroupMetadata, read_from_group

__all__ = [
    "AgentConfig",
    "AgentMetadata",
    "BadDescriptor",
    "CacheInfo",
    "FAULTS_ENV_VAR",
    "FaultConfig",
    "GroupMetadata",
    "IncompatibleLayout",
    "KVAgent",
    "LayerStreamer",
    "PeerLost",
    "RemoteError",
    "TransferError",
    "TransferHandle",
    "TransferState",
    "TransferTimeout",
    "read_from_group",
]
