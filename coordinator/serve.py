"""`pdserve serve`: start the pools on Ray, serve HTTP, and drain on Ctrl-C / SIGTERM.

Order: load and validate the YAML -> bind the listening socket -> start the workers (every one loaded, KV
capacity reported) -> freeze the start-up objects out of the garbage collector's way -> accept connections.
Binding first means a port in use fails in a second, before any worker starts, and Ray's own port allocations
(GCS, workers, object store) cannot take the port meanwhile.
On the first signal: new requests get 503, running streams get up to `server.drain_timeout_s` to finish, then
HTTP stops and the actors are shut down. A second signal skips the wait. A coordinator under `pdserve serve`'s
supervisor that fails with an exception after it served leaves its workers running for the next one to adopt.
The HTTP server itself is coordinator.api.http_server's.
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket

from coordinator.admission.tenant_usage_log import USAGE_LOG, UsageLog
from coordinator.admission.tenants import TenantRegistry
from coordinator.api.app import create_app, load_tokenizer
from coordinator.api.http_server import DrainingServer, log_serving, uvicorn_config
from coordinator.api.listener import bind_listener
from coordinator.config.serve_config import ServeConfig
from coordinator.observability.stall_reporter import start_stall_reporter


async def serve(config: ServeConfig, ready: asyncio.Event | None = None,
                listener: socket.socket | None = None, state_dir: str | None = None) -> None:
    """`listener`: a socket already listening (`pdserve serve`'s process supervisor holds it across coordinator
    restarts); None: bind server.host:server.port here. `state_dir`: the supervisor's state folder, where the
    tenants' token charges outlive this coordinator (coordinator.admission.tenant_usage_log)."""
    from coordinator.backend.ray_backend import (
        RayBackend,  # Ray only for the real server (tests build the HTTP config alone)
    )
    listener = listener or bind_listener(config.server.host, config.server.port)
    backend = RayBackend(config)
    stalls = None
    usage_log = UsageLog(os.path.join(state_dir, USAGE_LOG)) if state_dir is not None else None
    # a checkpoint's tokenizer (a 128k vocabulary: ~0.3 s here, ~0.5 s on an H200 host) is read while the workers
    # start, not after them; `tiny` is built by the backend's start first (and its tokenizer is small); HTTP in
    # other processes (api_processes > 1) reads its own there
    ahead = config.model != "tiny" and config.server.api_processes == 1
    reading = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, config.model)) if ahead else None
    try:
        await backend.start()
        tokenizer = await reading if reading is not None else None
        tenants = TenantRegistry(config.tenants, config.server.api_key, usage_log=usage_log)
        if config.server.api_processes > 1:
            from coordinator.frontends.core_process import serve_core
            await serve_core(config, backend, listener, ready, tenants)
            return
        stalls = start_stall_reporter(config.server, "coordinator")
        app = create_app(backend, config.server, config.tenants, registry=tenants, tokenizer=tokenizer)
        uv_config = uvicorn_config(app, config.server)
        server = DrainingServer(uv_config, app.state.lifecycle, config.server.drain_timeout_s)
        log_serving(config, backend)
        if ready is not None:
            ready.set()
        # what start-up built (Ray, torch, the app: ~0.2-0.5 M objects) lives as long as the server: collections
        # skip it from now on. A full collection over it stalled every stream ~0.1 s and cost ~9% of the CPU/token.
        gc.freeze()
        await server.serve(sockets=[listener])
    except Exception:
        if config.namespace is not None and ready is not None and ready.is_set():
            backend.pools.keep_fleet = True  # a crash, not a stop: the next coordinator adopts the workers
        raise
    finally:
        if reading is not None and not reading.done():
            reading.cancel()
        elif reading is not None and not reading.cancelled():
            reading.exception()  # retrieved: a start that failed has its own error to report
        if stalls is not None:
            stalls.stop()
        gc.unfreeze()  # exit as an unfrozen process: frozen objects are never freed at exit, and native bindings
        # (triton's nanobind) then print hundreds of "leaked" lines over the log's drain messages
        listener.close()
        if usage_log is not None:
            usage_log.close()
        await backend.shutdown()
