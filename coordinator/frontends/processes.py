"""Frontends: the core process's HTTP frontend processes (`server.api_processes` of them): start, watch, restart, stop.

Each is `python -m coordinator.frontends.main`, given the listening socket (inherited: every frontend accepts on the
same socket, and whichever is free first takes a new connection), the core's link path and the server settings.
A frontend that exits while the server is not stopping is restarted (after RESTART_DELAY_S, doubling up to
MAX_RESTART_DELAY_S while it keeps dying within STABLE_S of its start; its streams were
already ended by the core when its link closed, and its clients see their connections close). stop() sends each
SIGTERM (a frontend drains: new requests 503, running streams get `server.drain_timeout_s`), a second stop() sends
it again (stop now), and kill() ends what is left. Frontends stay in the core's process group (a signal to the
group reaches them too) but ignore SIGINT, so a Ctrl-C at the terminal acts once, through the core. The `pdserve
serve` watchdog (coordinator.cli) kills them if the core dies without a word; a frontend also exits by itself when
its link to the core ends.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import socket
import sys
from pathlib import Path

from coordinator.config.serve_config import ServeConfig

log = logging.getLogger("pdserve")
RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0
STABLE_S = 60.0  # a frontend that ran this long before it exited is restarted after RESTART_DELAY_S again
ROOT = Path(__file__).resolve().parents[2]


class Frontends:
    def __init__(self, config: ServeConfig, listener: socket.socket, link_path: str, workdir: str) -> None:
        self.count = config.server.api_processes
        self._listener = listener
        self._link_path = link_path
        self._settings_path = os.path.join(workdir, "frontend-settings.pickle")
        with open(self._settings_path, "wb") as f:
            pickle.dump((config.server, config.tenants), f)
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._stopping = False
        self._watchers: list[asyncio.Task] = []

    async def start(self) -> None:
        for index in range(self.count):
            await self._spawn(index)
            self._watchers.append(asyncio.get_running_loop().create_task(self._watch(index)))

    async def _spawn(self, index: int) -> None:
        fd = self._listener.fileno()
        self._procs[index] = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "coordinator.frontends.main", "--link", self._link_path, "--fd", str(fd),
            "--settings", self._settings_path, "--index", str(index), pass_fds=(fd,),
            cwd=str(ROOT), env={**os.environ, "PYTHONPATH": _python_path()})

    async def _watch(self, index: int) -> None:
        delay = RESTART_DELAY_S
        while True:
            started = asyncio.get_running_loop().time()
            code = await self._procs[index].wait()
            if self._stopping:
                return
            # one that keeps failing at once is retried less and less often (up to MAX_RESTART_DELAY_S apart)
            lived = asyncio.get_running_loop().time() - started
            delay = RESTART_DELAY_S if lived > STABLE_S else min(2 * delay, MAX_RESTART_DELAY_S)
            log.error("HTTP frontend %d exited (status %s) after %.0f s; restarting it in %.0f s", index, code, lived,
                      delay)
            await asyncio.sleep(delay)
            if self._stopping:
                return
            await self._spawn(index)

    def stop(self) -> None:
        """SIGTERM to every frontend: the first call drains them, a second stops them at once."""
        self._stopping = True
        for proc in self._procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)

    async def wait(self, timeout: float | None = None) -> bool:
        """Until every frontend has exited (after stop()) or `timeout`; True if they all did."""
        procs = [p.wait() for p in self._procs.values()]
        done, pending = await asyncio.wait([asyncio.ensure_future(p) for p in procs], timeout=timeout)
        for task in pending:
            task.cancel()
        return not pending

    def kill(self) -> None:
        self._stopping = True
        for task in self._watchers:
            task.cancel()
        for proc in self._procs.values():
            if proc.returncode is None:
                proc.kill()


def _python_path() -> str:
    """The frontends import pdserve from this checkout, whatever the core's working directory."""
    parts = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(parts)
