"""Backends that move a chunk of blocks, and the registry that picks one per remote agent by name.

- "ucx":      kvtransfer.backends.ucx (the client side; the server side: ucx_server), works between any two agents
              (also the control plane for all).
- "cuda_ipc": kvtransfer.backends.cuda_ipc, same host, both caches on GPUs that reach each other P2P.
An agent is configured with a preference order; for each remote the first available backend is used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..cache import RegisteredCache
from ..metadata import AgentMetadata


def _ucx_unavailable(local: RegisteredCache | None, remote: AgentMetadata, same_host: bool) -> str | None:
    return None


def _cuda_ipc_unavailable(local: RegisteredCache | None, remote: AgentMetadata, same_host: bool) -> str | None:
    if not same_host:
        return "the peer runs on another host"
    from .cuda_ipc import unavailable_reason

    return unavailable_reason(local, remote.cache)


# name -> function returning None if the backend can serve this pair, else the reason it cannot
REGISTRY: dict[str, Callable[[RegisteredCache | None, AgentMetadata, bool], str | None]] = {
    "ucx": _ucx_unavailable,
    "cuda_ipc": _cuda_ipc_unavailable,
}


def choose(
    preference: Sequence[str], local: RegisteredCache | None, remote: AgentMetadata, same_host: bool
) -> tuple[str, dict[str, str]]:
    """The first available backend in `preference`, and why each one before it was passed over."""
    skipped: dict[str, str] = {}
    for name in preference:
        if name not in REGISTRY:
            raise ValueError(f"unknown kvtransfer backend {name!r}; known: {sorted(REGISTRY)}")
        reason = REGISTRY[name](local, remote, same_host)
        if reason is None:
            return name, skipped
        skipped[name] = reason
    raise ValueError(f"no usable backend among {list(preference)}: {skipped}")
