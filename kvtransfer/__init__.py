"""kvtransfer: moves paged KV-cache blocks between workers (prefill -> decode), NIXL-style, over UCX.

Public API: `KVAgent` (+ `AgentConfig`), `AgentMetadata`, `GroupMetadata` and `read_from_group` (TP groups),
`TransferHandle` / `TransferState`, the errors, `LayerStreamer` for layer-wise pushes, and `FaultConfig` (injected
faults; env `PDSERVE_KV_FAULTS`). Depends on `engine.kv_layout`; nothing in engine imports this.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {  # public name -> the submodule defining it, imported on first use (PEP 562): a process that only
    # configures agents or catches their errors (the coordinator) imports no torch
    "AgentConfig": "agent_config", "KVAgent": "agent", "AgentMetadata": "metadata", "CacheInfo": "metadata",
    "BadDescriptor": "errors", "IncompatibleLayout": "errors", "PeerLost": "errors", "RemoteError": "errors",
    "TransferError": "errors", "TransferTimeout": "errors", "FaultConfig": "faults", "TransferHandle": "handle",
    "TransferState": "handle", "LayerStreamer": "streaming", "GroupMetadata": "tp_group",
    "read_from_group": "tp_group",
}


def __getattr__(name: str) -> Any:
    if name == "FAULTS_ENV_VAR":
        return importlib.import_module(".faults", __name__).ENV_VAR
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{home}", __name__), name)


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
