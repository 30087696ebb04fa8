"""Runs the real `pdserve serve` in a subprocess on a free loopback port for end-to-end tests.

The server starts its own local Ray cluster; stopping it with SIGTERM exercises the drain path, and the test
fails if it does not exit in time (then it is killed, so nothing is left running).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

START_TIMEOUT_S = 180
STOP_TIMEOUT_S = 60
HALF_CPU = {"num_cpus": 0.5, "kv_cache_memory_bytes": 64 << 20}  # two workers share one of CI's 2 cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Server:
    url: str
    pid: int

    def worker_pids(self, actor_class: str) -> list[int]:
        """PIDs of this server's Ray actors of one class (descendants of the server process only, so other
        Ray clusters on the machine are never touched)."""
        table = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
        parent, args = {}, {}
        for line in table.splitlines():
            pid, ppid, *cmd = line.split(None, 2)
            parent[int(pid)], args[int(pid)] = int(ppid), " ".join(cmd)

        def descends(pid: int) -> bool:
            while pid > 1:
                if pid == self.pid:
                    return True
                pid = parent.get(pid, 0)
            return False
        return [pid for pid, cmd in args.items() if f"ray::{actor_class}" in cmd and descends(pid)]


@contextmanager
def running_server(tmp_path: Path, config: dict):
    port = free_port()
    config = {**config, "server": {**config.get("server", {}), "host": "127.0.0.1", "port": port}}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "serve", str(path)], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, tmp_path / "server.log")
        yield Server(url, proc.pid)
    finally:
        exited = _stop(proc)
        log.close()
    assert exited, f"the server did not exit with status 0 within {STOP_TIMEOUT_S} s of SIGTERM; see {tmp_path}"


def metric_values(url: str, name: str) -> dict[str, float]:
    """{labels text: value} of one metric family from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)}


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy within {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen) -> bool:
    """SIGTERM, and True if the server drained and exited cleanly (status 0) in time."""
    if proc.poll() is not None:
        return proc.returncode == 0
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(STOP_TIMEOUT_S) == 0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False


async def complete(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """POST a completion; for streams, reassemble text, token count and finish reason from the SSE chunks."""
    if not body.get("stream"):
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        return {"text": data["choices"][0]["text"], "finish_reason": data["choices"][0]["finish_reason"],
                "completion_tokens": data["usage"]["completion_tokens"]}
    body = {**body, "stream_options": {"include_usage": True}}
    text, finish, usage = [], None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
    return {"text": "".join(text), "finish_reason": finish, "completion_tokens": usage["completion_tokens"]}


def wait_for_idle_workers(url: str, timeout_s: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        free = metric_values(url, "pdserve_worker_free_blocks")
        total = metric_values(url, "pdserve_worker_total_blocks")
        if free == total and len(free) > 0:
            return free
        if time.monotonic() > deadline:
            raise AssertionError(f"workers hold blocks after {timeout_s} s: free {free}, total {total}")
        time.sleep(0.25)
