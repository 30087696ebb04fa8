"""What one agent tells another so that they can connect and move blocks: `AgentMetadata`.

Torch-free and small, so the coordinator and the pools can pass it around (bytes over Ray) without CUDA.
`to_bytes()` / `from_bytes()` are the wire format (JSON; the optional CUDA IPC blob and UCX worker address are base64).
An agent is reached either at its UCX listener (`address`:`port`) or, with no listener, by its UCX worker address
and accept tag (`worker_address`, `accept_tag`: kvtransfer.backends.ucx_handshake).
A cache carries the global KV head range it holds (`engine.kv_heads`; default all heads): caches of a model's
TP ranks hold different ranges, and `check_compatible` compares what must agree for heads to move between them.
"""

from __future__ import annotations

import base64
import json
import os
import socket
from dataclasses import dataclass

from engine.kv_heads import KVHeadRange, transfer_incompatibility
from engine.kv_layout import KVCacheSpec

from .errors import IncompatibleLayout

PROTOCOL_VERSION = 5  # 2: caches carry head ranges, reads may name a head range; 3: control messages are frames;
# 4: notifications go over a TCP stream (`notify_port`); 5: an agent may be reached by its UCX worker address


def host_identity() -> str:
    """A string equal for two processes exactly when they run on the same host (hostname + boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class CacheInfo:
    """The registered KV cache: `spec` plus how many blocks it has and where it lives."""

    spec: KVCacheSpec
    num_blocks: int
    device: str  # "cpu" | "cuda"
    device_uuid: str | None = None  # CUDA device UUID (None on the CPU)
    ipc_handle: bytes | None = None  # opaque CUDA IPC export of the cache (intra-host path), or None
    heads: KVHeadRange | None = None  # the global KV heads it holds; None: all of them (no TP)

    def __post_init__(self) -> None:
        try:
            self.head_range.check_spec(self.spec)
        except ValueError as e:
            raise IncompatibleLayout(f"cache info: {e}") from e

    @property
    def head_range(self) -> KVHeadRange:
        return self.heads if self.heads is not None else KVHeadRange.full(self.spec.num_kv_heads)

    def describe(self) -> str:
        h = self.head_range
        return (f"model {self.spec.model_id!r}, KV heads [{h.start}, {h.stop}) of {h.total}, {self.spec.num_layers} "
                f"layers, head_dim {self.spec.head_dim}, block {self.spec.block_size}, {self.spec.dtype}")

    def to_dict(self) -> dict:
        return {
            "spec": self.spec.to_dict(),
            "num_blocks": self.num_blocks,
            "device": self.device,
            "device_uuid": self.device_uuid,
            "ipc_handle": base64.b64encode(self.ipc_handle).decode() if self.ipc_handle else None,
            "heads": self.heads.to_list() if self.heads is not None else None,
        }

    @classmethod
    def from_dict(cls, d: dict) -> CacheInfo:
        ipc = d.get("ipc_handle")
        return cls(
            spec=KVCacheSpec.from_dict(d["spec"]),
            num_blocks=int(d["num_blocks"]),
            device=str(d["device"]),
            device_uuid=d.get("device_uuid"),
            ipc_handle=base64.b64decode(ipc) if ipc else None,
            heads=KVHeadRange.from_list(d["heads"]) if d.get("heads") is not None else None,
        )


@dataclass(frozen=True)
class AgentMetadata:
    """Everything needed to reach an agent and address its registered cache."""

    name: str
    address: str  # host name or IP the agent's listeners are reachable at
    port: int  # its UCX listener's port; 0 when it has none (reached by `worker_address`)
    host_id: str  # host_identity() of the agent's process
    pid: int
    cache: CacheInfo | None
    notify_port: int | None = None  # the agent's notification listener (kvtransfer.notify_channel), at `address`
    worker_address: bytes | None = None  # its UCX worker's address, when peers connect by it (no UCX listener)
    accept_tag: int | None = None  # the tag its connection requests are sent on (with `worker_address`)
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if (self.worker_address is None) != (self.accept_tag is None):
            raise IncompatibleLayout(f"agent metadata of {self.name!r}: worker_address and accept_tag go together")

    @property
    def identity(self) -> tuple:
        """What tells one agent from a successor under the same name."""
        return (self.name, self.address, self.port, self.host_id, self.pid)

    def to_bytes(self) -> bytes:
        d = {
            "name": self.name,
            "address": self.address,
            "port": self.port,
            "host_id": self.host_id,
            "pid": self.pid,
            "cache": self.cache.to_dict() if self.cache else None,
            "notify_port": self.notify_port,
            "worker_address": base64.b64encode(self.worker_address).decode() if self.worker_address else None,
            "accept_tag": self.accept_tag,
            "protocol_version": self.protocol_version,
        }
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> AgentMetadata:
        try:
            d = json.loads(data)
            return cls(
                name=str(d["name"]),
                address=str(d["address"]),
                port=int(d["port"]),
                host_id=str(d["host_id"]),
                pid=int(d["pid"]),
                cache=CacheInfo.from_dict(d["cache"]) if d.get("cache") else None,
                notify_port=int(d["notify_port"]) if d.get("notify_port") is not None else None,
                worker_address=base64.b64decode(d["worker_address"]) if d.get("worker_address") else None,
                accept_tag=int(d["accept_tag"]) if d.get("accept_tag") is not None else None,
                protocol_version=int(d.get("protocol_version", -1)),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise IncompatibleLayout(f"unreadable agent metadata: {e}") from e

    def same_host_as(self, other: AgentMetadata) -> bool:
        return self.host_id == other.host_id


def check_compatible(local: CacheInfo | None, remote: AgentMetadata, local_name: str = "this agent") -> None:
    """Raise IncompatibleLayout unless heads can move between `local` and `remote`'s cache (their head ranges
    may differ; see engine.kv_heads); the message names both sides and the differing fields (ours != theirs)."""
    if remote.protocol_version != PROTOCOL_VERSION:
        raise IncompatibleLayout(f"agent {remote.name!r} speaks protocol {remote.protocol_version}, "
                                 f"{local_name!r} speaks {PROTOCOL_VERSION}")
    if local is None or remote.cache is None:
        return  # nothing registered yet on one side: notifications only; transfers check again
    theirs = remote.cache
    reason = transfer_incompatibility(local.spec, local.head_range, theirs.spec, theirs.head_range)
    if reason:
        raise IncompatibleLayout(f"KV caches of {local_name!r} ({local.describe()}) and {remote.name!r} "
                                 f"({theirs.describe()}) are incompatible: {reason}")


def default_address() -> str:
    """The address to advertise: $KVTRANSFER_ADDRESS, else this host's primary IP, else loopback."""
    env = os.environ.get("KVTRANSFER_ADDRESS")
    if env:
        return env
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
