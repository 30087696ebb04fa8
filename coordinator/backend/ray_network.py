"""Where a single-host server's Ray cluster and KV transfers listen: on the loopback only.

Ray puts each server of a node (GCS, raylet, object manager, its agents, every worker's gRPC server) on the node's
address, and on every interface once that address is not the loopback (Ray 2.60, seen with `ss -ltnp`). A local
Ray that `pdserve serve` starts is one machine, so `confine_local_ray(environ)` puts its node on the loopback, in
Ray's own single-machine mode (the one it runs on macOS and Windows: `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, read
when Ray is imported, so this runs before). The coordinator and the workers inherit the environment, and with it
`UCX_NET_DEVICES=lo` (unless the operator set UCX_NET_DEVICES), which keeps UCX's transports between KV agents on
the loopback; each agent advertises and listens on its Ray node's address (pool_worker.worker), and peers reach it
by its UCX worker address, so that it has no UCX listener (which ucxx opens on every interface:
coordinator.backend.pools).
A server that joins a cluster (`ray_address`) leaves Ray's addresses to the cluster's own `ray start`
(--node-ip-address); its KV agents carry KV over, and listen on, the devices `transfer.net_devices` names
(docs/operations.md, Security model).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping

RAY_CLUSTERS_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": a node on the loopback, no other node may join
UCX_DEVICES_ENV = "UCX_NET_DEVICES"
log = logging.getLogger("pdserve")


def confine_local_ray(environ: MutableMapping[str, str]) -> None:
    """Set `environ` (this process's, before it imports Ray) so that the local Ray it starts, and the KV
    transfers between that Ray's workers, listen on the loopback."""
    if "ray" in sys.modules:
        log.error("pdserve: Ray was imported before its node could be put on the loopback: its servers will "
                  "listen on every interface")
    environ[RAY_CLUSTERS_ENV] = "0"
    environ.setdefault(UCX_DEVICES_ENV, "lo")

