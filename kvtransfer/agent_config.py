"""AgentConfig: a KV agent's settings (chunk sizes, staging, deadlines, backends, injected faults).

Apart from kvtransfer.agent so that a process which only configures agents (the coordinator) imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .faults import FaultConfig


@dataclass(frozen=True)
class AgentConfig:
    max_chunk_bytes: int = 4 << 30  # one cuda_ipc kernel launch moves at most this much
    ucx_chunk_bytes: int = 512 << 20  # one UCX message carries at most this much (fewer round trips)
    staging_bytes: int = 1 << 30  # per staging pool (client side, serving side, and per IPC peer GPU)
    timeout_s: float = 30.0  # default deadline of a transfer
    connect_timeout_s: float = 10.0
    backends: tuple[str, ...] = ("cuda_ipc", "ucx")  # preference order
    faults: FaultConfig | None = None  # injected faults; None: those in $PDSERVE_KV_FAULTS, if set, else none

    def __post_init__(self) -> None:
        if isinstance(self.faults, Mapping):  # a YAML section
            object.__setattr__(self, "faults", FaultConfig.from_dict(self.faults))
        if self.faults is not None and not isinstance(self.faults, FaultConfig):
            raise ValueError(f"AgentConfig.faults must be a FaultConfig, a mapping of its fields or None, "
                             f"got {self.faults!r}")
