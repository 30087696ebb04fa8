"""Launch `pdserve serve` for one sweep layout as a subprocess, wait until it is healthy, stop it with SIGTERM.

Owns the server process of a sweep cell: the composed serving YAML (base config + overrides + layout + a free
loopback port) is written next to its log in the cell's folder; a server that exits or is not healthy within
`start_timeout_s` raises `LaunchError` with the log's tail. A free port can be taken by another process before
the server binds it, so a server that reports its port taken starts again on another (PORT_ATTEMPTS times).
On leaving, SIGTERM drains it and, if it has not exited within `stop_timeout_s`, its whole process group is
killed, so no server outlives the sweep, also when the sweep itself gets SIGTERM (a scheduler, `timeout`): while a
server runs, that signal raises SystemExit in the main thread, as Ctrl-C raises KeyboardInterrupt, so the stop runs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml


class LaunchError(RuntimeError):
    pass


class PortTaken(LaunchError):
    """The server could not listen on its port."""


PORT_ATTEMPTS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving_config(base: Path, overrides: dict[str, Any], port: int | None, ray_address: str | None) -> dict:
    """The base YAML with dotted `overrides` applied, listening on 127.0.0.1:`port` (None: a free one)."""
    config = yaml.safe_load(base.read_text(encoding="utf-8")) or {}
    config.pop("ray_address", None)
    if ray_address:
        config["ray_address"] = ray_address
    for dotted, value in {**overrides, "server.host": "127.0.0.1", "server.port": port}.items():
        node = config
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return config


@dataclass(frozen=True)
class LaunchedServer:
    url: str  # base URL, e.g. http://127.0.0.1:8123
    pid: int  # the `pdserve serve` process (its Ray workers are its descendants)


@contextmanager
def launched_server(config: dict, workdir: Path, start_timeout_s: float = 600.0,
                    stop_timeout_s: float = 90.0) -> Iterator[LaunchedServer]:
    """Runs `pdserve serve` until the block ends; `config`'s server.port None means a free loopback port.
    Raises LaunchError if it does not start, or does not drain and exit with status 0 after SIGTERM."""
    workdir.mkdir(parents=True, exist_ok=True)
    with _sigterm_as_exit() as shield:
        proc, url = _start(config, workdir, start_timeout_s)
        try:
            yield LaunchedServer(url, proc.pid)
        finally:
            shield()  # a second SIGTERM must not cut the stop short (and leave a draining server behind)
            stopped = _stop(proc, stop_timeout_s)
    if not stopped:
        raise LaunchError(f"the server did not exit with status 0 within {stop_timeout_s:g} s of SIGTERM; "
                          f"see {workdir / 'server.log'}")


@contextmanager
def _sigterm_as_exit() -> Iterator[Callable[[], None]]:
    """Within the block, SIGTERM raises SystemExit (status 143) instead of ending the process on the spot, so the
    blocks that stop the server run; the function it gives ignores further SIGTERMs (call it before stopping). Only
    in the main thread (where Python runs signal handlers) and only where SIGTERM still has its default action: a
    program's own handler is left alone. The default action is back after the block."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield lambda: None
        return

    def raise_exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, raise_exit)
    try:
        yield lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _start(config: dict, workdir: Path, timeout_s: float) -> tuple[subprocess.Popen, str]:
    """The healthy server process and its URL."""
    chosen = config["server"].get("port")
    path, log_path = workdir / "serve.yaml", workdir / "server.log"
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = chosen if chosen is not None else free_port()
        path.write_text(yaml.safe_dump({**config, "server": {**config["server"], "port": port}}, sort_keys=False))
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "serve", str(path)], stdout=log,
                                    stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                    start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(proc, url, log_path, timeout_s)
            return proc, url
        except PortTaken:
            if chosen is not None or attempt == PORT_ATTEMPTS:
                raise
        except BaseException:
            _stop(proc, 10)
            raise
    raise AssertionError("unreachable")


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = _tail(log)
            kind = PortTaken if "pdserve: error: cannot listen on" in tail else LaunchError
            raise kind(f"the server exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise LaunchError(f"the server was not healthy within {timeout_s:g} s:\n{_tail(log)}")


def _stop(proc: subprocess.Popen, timeout_s: float) -> bool:
    """SIGTERM (drain), then SIGKILL to the process group; True if it exited on its own with status 0."""
    if proc.poll() is not None:
        return proc.returncode == 0
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s) == 0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:]
