"""A configuration's relative paths are taken from the directory `pdserve serve` runs in (the supervisor makes them
absolute for its coordinator, which runs in the project's folder, and for the workers), and a folder there named like
one of pdserve's packages shadows nothing. A model folder that does not exist is refused before anything starts,
with the folder it looked for."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from benchclient.launcher import free_port
from tests.server_process import HALF_CPU

pytestmark = pytest.mark.timeout(300)
PDSERVE = str(Path(sys.executable).parent / "pdserve")  # the console script, as users run it


def _write_config(folder: Path, model: str, port: int) -> None:
    config = {"model": model, "mode": "collocated", "prefill": dict(HALF_CPU), "decode": dict(HALF_CPU),
              "server": {"host": "127.0.0.1", "port": port}}
    (folder / "serve.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                return
        except httpx.TransportError:  # not listening yet
            pass
        time.sleep(0.2)
    raise AssertionError(f"no /health 200 within {timeout_s} s: {log.read_text()[-3000:]}")


def test_a_relative_model_path_is_served_from_the_launch_directory(tmp_path):
    from engine.tiny import ensure_tiny_model
    shutil.copytree(ensure_tiny_model(), tmp_path / "m")
    (tmp_path / "engine").mkdir()  # a user's own package named like ours: imported, it would break the server
    (tmp_path / "engine" / "__init__.py").write_text("raise ImportError('the launch directory shadowed engine')\n")
    port = free_port()
    _write_config(tmp_path, "./m", port)
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen([PDSERVE, "serve", "serve.yaml"], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, tmp_path / "server.log")
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["m"], models
        for name in ("m", str(tmp_path / "m")):  # the id, and the configured model (made absolute)
            body = {"model": name, "prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the supervisor and what it started
            raise
    assert rc == 0, (tmp_path / "server.log").read_text()[-3000:]


def test_a_missing_model_folder_is_refused_before_anything_starts(tmp_path):
    _write_config(tmp_path, "./nowhere", free_port())
    done = subprocess.run([PDSERVE, "serve", "serve.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"model './nowhere': no such checkpoint folder {tmp_path / 'nowhere'}" in done.stderr, done.stderr
    assert "Ray" not in done.stderr and "Traceback" not in done.stderr, done.stderr
