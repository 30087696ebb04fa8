"""The HTTP server pdserve serves its app with, in one process or in each HTTP frontend process.

`uvicorn_config()`: uvicorn's httptools protocol with a request-head timeout and size limit added
(coordinator.api.http_protocol, `server.header_timeout_s`, `server.max_request_header_bytes`),
`server.keep_alive_timeout_s` for idle keep-alive connections, and logging whose every line carries the request id
(`[%(request_id)s]`, "-" outside a request); every HTTP process (`server.api_processes`) serves with it.
`DrainingServer`: its first exit signal drains in-flight requests. (The listening socket it serves on:
coordinator.api.listener.)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn

from coordinator.api.http_protocol import HeadTimeoutProtocol
from coordinator.config.serve_config import ServeConfig
from coordinator.config.settings import ServerSettings

log = logging.getLogger("pdserve")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def log_config() -> dict[str, Any]:
    """logging.config.dictConfig for `pdserve serve`: uvicorn's loggers and the root, every line with its request id."""
    filters = ["request_id"]
    stream = {"class": "logging.StreamHandler", "filters": filters}
    access = ('%(asctime)s %(levelprefix)s [%(request_id)s] %(client_addr)s - "%(request_line)s" %(status_code)s')
    return {
        "version": 1, "disable_existing_loggers": False,
        "filters": {"request_id": {"()": "coordinator.errors.RequestIdFilter"}},
        "formatters": {"default": {"format": LOG_FORMAT},
                       "access": {"()": "uvicorn.logging.AccessFormatter", "fmt": access, "use_colors": False}},
        "handlers": {"default": {**stream, "formatter": "default", "stream": "ext://sys.stderr"},
                     "access": {**stream, "formatter": "access", "stream": "ext://sys.stdout"}},
        "root": {"handlers": ["default"], "level": "WARNING"},
        "loggers": {"coordinator.requests": {"level": "INFO"},  # `user` and `metadata` of requests (protocol.py)
                    "coordinator.placement": {"level": "INFO"},  # where adaptive prompts are prefilled, and why
                    "uvicorn": {"handlers": ["default"], "level": "INFO", "propagate": False},
                    "uvicorn.access": {"handlers": ["access"], "level": "INFO", "propagate": False}},
    }


def uvicorn_config(app: Any, settings: ServerSettings, **overrides: Any) -> uvicorn.Config:
    """The uvicorn.Config pdserve serves `app` with (`overrides`: tests pass log_config=None)."""
    limits = {"header_timeout_s": settings.header_timeout_s, "max_head_bytes": settings.max_request_header_bytes}
    protocol = type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), limits)
    kwargs: dict[str, Any] = dict(host=settings.host, port=settings.port, log_level="info", log_config=log_config(),
                                  timeout_graceful_shutdown=5, http=protocol,
                                  timeout_keep_alive=settings.keep_alive_timeout_s)
    return uvicorn.Config(app, **{**kwargs, **overrides})


class DrainingServer(uvicorn.Server):
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


def log_serving(config: ServeConfig, backend: Any) -> None:
    processes = f", {config.server.api_processes} HTTP processes" if config.server.api_processes > 1 else ""
    log.warning("pdserve: %s mode, %d prefill + %d decode workers%s, serving %s on http://%s:%d", config.mode,
                len(backend.pools.prefill), len(backend.pools.decode), processes, backend.model_name,
                config.server.host, config.server.port)
