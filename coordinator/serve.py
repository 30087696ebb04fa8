"""`pdserve serve`: start the pools on Ray, serve HTTP, and drain on Ctrl-C / SIGTERM.

Order: load and validate the YAML -> bind the listening socket -> start the workers (every one loaded, KV
capacity reported) -> accept connections. Binding first means a port in use fails in a second, before any
worker starts, and Ray's own port allocations (GCS, workers, object store) cannot take the port meanwhile.
On the first signal: new requests get 503, running streams get up to `server.drain_timeout_s` to finish, then
HTTP stops and the actors are shut down. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from coordinator.app import create_app
from coordinator.ray_backend import RayBackend
from coordinator.serve_config import ServeConfig

log = logging.getLogger("pdserve")


class _DrainingServer(uvicorn.Server):
    """uvicorn.Server whose exit signal first drains in-flight requests."""

    def __init__(self, config: uvicorn.Config, lifecycle, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._lifecycle = lifecycle
        self._drain_timeout_s = drain_timeout_s
        self._draining: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._draining is not None:  # second signal: stop now
            return super().handle_exit(sig, frame)
        log.warning("draining: new requests get 503; waiting up to %.0f s for running ones",
                    self._drain_timeout_s)
        self._lifecycle.begin_drain()
        self._draining = asyncio.get_event_loop().create_task(self._drain_then_exit(sig, frame))

    async def _drain_then_exit(self, sig: int, frame) -> None:
        await self._lifecycle.wait_idle(self._drain_timeout_s)
        # exit without recording the signal: uvicorn would re-raise it after shutdown, and Ray's SIGTERM
        # handler turns that into exit status 15 although the drain handled it
        self.should_exit = True


class ListenError(OSError):
    pass


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (uvicorn serves on it); ListenError names the address and the cause."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: rebinding over TIME_WAIT is fine
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port} (server.host/server.port): {e.strerror}") from e
    sock.listen(2048)
    return sock


async def serve(config: ServeConfig, ready: asyncio.Event | None = None) -> None:
    listener = bind_listener(config.server.host, config.server.port)
    backend = RayBackend(config)
    try:
        await backend.start()
        app = create_app(backend, config.server)
        uv_config = uvicorn.Config(app, host=config.server.host, port=config.server.port, log_level="info",
                                   timeout_graceful_shutdown=5)
        server = _DrainingServer(uv_config, app.state.lifecycle, config.server.drain_timeout_s)
        log.warning("pdserve: %s mode, %d prefill + %d decode workers, serving %s on http://%s:%d",
                    config.mode, len(backend.pools.prefill), len(backend.pools.decode), backend.model_name,
                    config.server.host, config.server.port)
        if ready is not None:
            ready.set()
        await server.serve(sockets=[listener])
    finally:
        listener.close()
        await backend.shutdown()
