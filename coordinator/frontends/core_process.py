"""serve_core: `pdserve serve` with `server.api_processes` > 1, the core process's part after its workers are up.

Order: the CoreService listens on a Unix socket in a private temporary folder -> the frontends start (each inherits
the listening socket) -> every one says it accepts connections (else start-up fails, naming the setting) -> serving.
On the first SIGINT / SIGTERM the frontends drain (each stops taking requests, then waits up to
`server.drain_timeout_s` for its streams) and exit; a second signal stops them at once. Then the core closes its
links and the caller shuts the workers down. Why a separate core: one Python event loop serving every stream's
per-token work saturates near one core on fast models, and then a high-priority request's parse, admission and first
chunk queue behind the flood's chunks; spread over processes, each loop keeps headroom.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import shutil
import signal
import socket
import tempfile
from typing import Any

from coordinator.admission.tenants import TenantRegistry
from coordinator.api.http_server import log_serving
from coordinator.config.serve_config import ServeConfig
from coordinator.frontends.core_service import CoreService
from coordinator.frontends.processes import Frontends
from coordinator.observability.stall_reporter import start_stall_reporter

log = logging.getLogger("pdserve")
READY_TIMEOUT_S = 120.0
EXIT_GRACE_S = 10.0  # beyond the drain, for a frontend to close its connections and exit


async def serve_core(config: ServeConfig, backend: Any, listener: socket.socket,
                     ready: asyncio.Event | None = None, tenants: TenantRegistry | None = None) -> None:
    """`tenants`: the tenants' live state (coordinator.serve's, with its usage log); by default one of the config's."""
    settings = config.server
    workdir = tempfile.mkdtemp(prefix="pdserve-core-")
    service = CoreService(backend, tenants or TenantRegistry(config.tenants, settings.api_key))
    frontends = Frontends(config, listener, os.path.join(workdir, "core.sock"), workdir)
    stop = asyncio.Event()
    signals = 0
    stalls = None

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            log.warning("draining: the HTTP processes refuse new requests and wait up to %.0f s for running ones",
                        settings.drain_timeout_s)
        frontends.stop()
        stop.set()

    loop = asyncio.get_running_loop()
    try:
        await service.start(os.path.join(workdir, "core.sock"))
        await frontends.start()
        if not await service.wait_ready(frontends.count, READY_TIMEOUT_S):
            raise RuntimeError(f"server.api_processes: {frontends.count} HTTP processes did not all start within "
                               f"{READY_TIMEOUT_S:.0f} s (see their log lines above)")
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        stalls = start_stall_reporter(settings, "core")
        log_serving(config, backend)
        if ready is not None:
            ready.set()
        gc.freeze()
        await stop.wait()
        if not await frontends.wait(settings.drain_timeout_s + EXIT_GRACE_S):
            log.warning("HTTP processes still running after the drain: killing them")
    finally:
        if stalls is not None:
            stalls.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        frontends.kill()
        await service.close()
        shutil.rmtree(workdir, ignore_errors=True)
