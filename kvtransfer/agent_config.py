"""AgentConfig: a KV agent's settings (chunk sizes, staging, deadlines, handshake retries, backends, how peers
connect to it, faults).

Apart from kvtransfer.agent so that a process which only configures agents (the coordinator) imports no torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from .faults import FaultConfig

UCX_CONNECT = ("worker_address", "listener")  # AgentConfig.ucx_connect's values


@dataclass(frozen=True)
class HandshakePolicy:
    """How a connection to a peer is tried: each attempt gets `attempt_s` (or what is left of the deadline); a
    timed-out or broken one is tried again after `backoff_s`, doubled each time, up to `attempts` in all."""

    attempts: int = 4
    attempt_s: float = 4.0
    backoff_s: float = 0.2

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"handshake attempts must be >= 1, got {self.attempts}")
        if not self.attempt_s > 0 or not self.backoff_s >= 0:
            raise ValueError(f"handshake attempt_s must be > 0 and backoff_s >= 0, got {self.attempt_s}, "
                             f"{self.backoff_s}")

    def backoffs(self, deadline: float) -> Iterator[float]:
        """The waits before attempts 2, 3, ...: stops after `attempts` - 1 of them, or when the next attempt
        would start past `deadline`."""
        wait = self.backoff_s
        for _ in range(self.attempts - 1):
            if time.monotonic() + wait >= deadline:
                return
            yield wait
            wait *= 2


@dataclass(frozen=True)
class AgentConfig:
    max_chunk_bytes: int = 4 << 30  # one cuda_ipc kernel launch moves at most this much
    ucx_chunk_bytes: int = 512 << 20  # one UCX message carries at most this much (fewer round trips)
    staging_bytes: int = 1 << 30  # per staging pool (client side, serving side, and per IPC peer GPU)
    timeout_s: float = 30.0  # default deadline of a transfer
    connect_timeout_s: float = 10.0  # add_remote's deadline for connecting (a transfer reconnects within its own)
    handshake_attempts: int = 4  # a handshake that timed out is tried again, at most this many attempts in all
    handshake_attempt_s: float = 4.0  # one attempt's time (or what is left of the deadline)
    handshake_backoff_s: float = 0.2  # wait before the second attempt, doubled before each further one
    backends: tuple[str, ...] = ("cuda_ipc", "ucx")  # preference order
    # the address the agent advertises, where its notification listener listens (None: $KVTRANSFER_ADDRESS, else
    # this host's primary IP); a pool worker sets its Ray node's (pool_worker.worker)
    address: str | None = None
    # how peers open a UCX connection to the agent: "worker_address" (by its UCX worker's address, sent with its
    # metadata: no UCX listening socket; the data transports' sockets follow UCX_NET_DEVICES) or "listener" (a UCX
    # connection listener, which ucxx opens on every interface: a cluster's, coordinator.backend.pools)
    ucx_connect: str = "worker_address"
    # the network devices UCX may use and listen on, as UCX_NET_DEVICES names them ("eth1", "mlx5_0:1"); set in
    # the agent's process before its first UCX call (worker_setup.start_agent). None: the environment's
    net_devices: str | None = None
    faults: FaultConfig | None = None  # injected faults; None: those in $PDSERVE_KV_FAULTS, if set, else none

    def __post_init__(self) -> None:
        self.handshake  # noqa: B018 - validates the handshake fields now
        if self.ucx_connect not in UCX_CONNECT:
            raise ValueError(f"AgentConfig.ucx_connect must be one of {', '.join(UCX_CONNECT)}, got "
                             f"{self.ucx_connect!r}")
        if isinstance(self.faults, Mapping):  # a YAML section
            object.__setattr__(self, "faults", FaultConfig.from_dict(self.faults))
        if self.faults is not None and not isinstance(self.faults, FaultConfig):
            raise ValueError(f"AgentConfig.faults must be a FaultConfig, a mapping of its fields or None, "
                             f"got {self.faults!r}")

    @property
    def handshake(self) -> HandshakePolicy:
        """The handshake's retry policy from the handshake_* fields."""
        return HandshakePolicy(self.handshake_attempts, self.handshake_attempt_s, self.handshake_backoff_s)
