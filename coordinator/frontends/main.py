"""One HTTP frontend process: the OpenAI-compatible app over CoreBackend, served on the socket the core listens on.

Started by coordinator.frontends.processes. Runs the same app, uvicorn configuration and drain as a one-process
server (coordinator.serve); only the backend (the core, over a Link) and the tenants' buckets (the core's) differ.
It tells the core it is ready once uvicorn accepts connections, and exits when the core's link ends.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging.config
import pickle
import signal
import socket
import sys

from coordinator.api.app import create_app
from coordinator.api.http_server import DrainingServer, log_config, uvicorn_config
from coordinator.frontends.core_client import CoreBackend
from coordinator.frontends.http_loop import HttpLoopCollector
from coordinator.frontends.remote_tenants import RemoteTenants
from coordinator.observability.loop_lag import LoopLag
from coordinator.observability.stall_reporter import start_stall_reporter

log = logging.getLogger("pdserve")


class FrontendServer(DrainingServer):
    """Ignores SIGINT: a Ctrl-C at the terminal reaches the whole process group, and the core passes it on as
    SIGTERM (once: a second signal would skip the drain)."""

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGINT:
            super().handle_exit(sig, frame)


async def run(link_path: str, fd: int, settings_path: str, index: int) -> None:
    with open(settings_path, "rb") as f:
        settings, tenants = pickle.load(f)
    backend = CoreBackend(link_path, index)
    await backend.start()
    app = create_app(backend, settings, tenants, registry=RemoteTenants(tenants, settings.api_key, backend))
    lag = LoopLag()  # this process's loop, in /metrics per process (the core's is pdserve_coordinator_loop_*)
    app.state.metrics.add_local(HttpLoopCollector(lag, index))
    backend.local_metrics = app.state.metrics.local_families
    server = FrontendServer(uvicorn_config(app, settings), app.state.lifecycle, settings.drain_timeout_s)

    def core_lost() -> None:
        log.error("HTTP frontend %d: the core process is gone; exiting", index)
        server.should_exit = True

    async def tell_ready() -> None:
        while not server.started:
            await asyncio.sleep(0.01)
        backend.notify("frontend_ready", index)

    backend.on_lost = core_lost
    ready = asyncio.get_running_loop().create_task(tell_ready())
    sock = socket.socket(fileno=fd)
    lag.start()
    stalls = start_stall_reporter(settings, f"HTTP process {index}")
    gc.freeze()  # as the one-process server: what start-up built stays out of full collections
    try:
        await server.serve(sockets=[sock])
    finally:
        ready.cancel()
        lag.stop()
        if stalls is not None:
            stalls.stop()
        gc.unfreeze()
        await backend.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coordinator.frontends.main")
    p.add_argument("--link", required=True, help="the core's Unix socket")
    p.add_argument("--fd", type=int, required=True, help="the inherited listening socket")
    p.add_argument("--settings", required=True, help="pickled (ServerSettings, TenantsConfig)")
    p.add_argument("--index", type=int, default=0)
    args = p.parse_args(argv)
    logging.config.dictConfig(log_config())
    asyncio.run(run(args.link, args.fd, args.settings, args.index))
    return 0


if __name__ == "__main__":
    sys.exit(main())
