"""The server binds its port before starting any worker: a taken port fails fast and clearly, and the launcher
(sweeps, these tests) starts the server again on another free port when a race took the one it chose."""

import socket
import subprocess
import sys

import httpx

from benchclient import launcher
from tests.server_process import HALF_CPU, running_server


def _listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def test_a_taken_port_fails_before_ray_starts_and_names_the_setting():
    with _listening_socket() as taken:
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "coordinator.cli", "serve", "configs/default.yaml",
                               "--host", "127.0.0.1", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert f"pdserve: error: cannot listen on 127.0.0.1:{port} (server.host/server.port)" in proc.stderr
    assert "Ray" not in proc.stderr  # failed before any worker or Ray instance started


def test_the_launcher_retries_on_another_port_when_its_choice_was_taken(tmp_path, monkeypatch):
    with _listening_socket() as taken:
        chosen: list[int] = []
        real_free_port = launcher.free_port

        def first_the_taken_port() -> int:
            chosen.append(real_free_port() if chosen else taken.getsockname()[1])
            return chosen[-1]
        monkeypatch.setattr(launcher, "free_port", first_the_taken_port)
        with running_server(tmp_path, {"model": "tiny", "prefill": HALF_CPU, "decode": HALF_CPU}) as server:
            assert len(chosen) == 2 and server.url == f"http://127.0.0.1:{chosen[1]}"
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert "cannot listen on" not in (tmp_path / "server.log").read_text()  # the log of the attempt that ran
