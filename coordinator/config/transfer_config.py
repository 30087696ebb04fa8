"""The KV transfer's settings (`transfer:`): the backends KV moves over between the pools, its timeouts, whether the
prefill worker pushes or the decode worker pulls, what a failed transfer does, the network devices UCX uses, and
when a prefill worker fetches a prompt's prefix from another worker.

    transfer: {backends: [cuda_ipc, ucx], timeout_s: 30, on_failure: recompute, push: true, net_devices: eth1,
               prefix_fetch_min_tokens: 256}
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NET_DEVICES = re.compile(r"[A-Za-z0-9_.:-]{1,32}(,[A-Za-z0-9_.:-]{1,32}){0,15}")  # UCX_NET_DEVICES' form


@dataclass(frozen=True)
class TransferConfig:
    backends: tuple[str, ...] = ("cuda_ipc", "ucx")
    timeout_s: float = 30.0
    pin_lease_s: float = 60.0
    on_failure: str = "recompute"  # a failed KV transfer: the decode worker recomputes the prompt, or the request fails
    # the prefill worker writes each prompt's KV into the blocks its decode worker booked, layer group by layer
    # group during the forward (prefill_pool.kv_push), so decode only joins; false: decode pulls it after the prefill.
    # Pools of tensor_parallel_size 1 only (larger ones pull)
    push: bool = True
    # the network devices UCX carries KV over and listens on (UCX_NET_DEVICES: "eth1", "mlx5_0:1,eth1"), set in
    # every worker; null: the workers' environment decides (a single-host server's is "lo": ray_network)
    net_devices: str | None = None
    # a prefill worker fetches a prompt's leading blocks from another worker's prefix cache or host tier through the
    # transfer (coordinator.backend.prefix_fetch) when that worker likely holds at least this many tokens more of
    # them than the prefill worker does; null: never (each worker computes what it does not hold itself)
    prefix_fetch_min_tokens: int | None = 256

    def __post_init__(self) -> None:
        if self.prefix_fetch_min_tokens is not None and self.prefix_fetch_min_tokens < 1:
            raise ValueError(f"prefix_fetch_min_tokens must be at least 1 (null: never fetch), got "
                             f"{self.prefix_fetch_min_tokens!r}")
        if self.net_devices is not None and not NET_DEVICES.fullmatch(self.net_devices):
            raise ValueError(f"net_devices must name network devices as UCX_NET_DEVICES does (\"eth1\", "
                             f"\"mlx5_0:1,eth1\"), got {self.net_devices[:64]!r}")

