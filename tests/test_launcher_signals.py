"""A program that launched `pdserve serve` through benchclient's launcher (a sweep, a benchmark) and is then
stopped with SIGTERM (a scheduler, `timeout`) stops its server before it exits: no server outlives it."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

PROGRAM = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from benchclient.launcher import launched_server
    config = {"model": "tiny", "mode": "collocated",
              "decode": {"num_cpus": 0.5, "kv_cache_memory_bytes": 64 << 20},
              "server": {"host": "127.0.0.1", "port": None}}
    with launched_server(config, Path(sys.argv[1]), 180, 60) as server:
        print(server.pid, flush=True)
        time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().rsplit(")", 1)[1].split()[0] == "Z")  # a zombie is gone


def test_sigterm_to_the_launching_program_stops_its_server(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    try:
        server_pid = int(proc.stdout.readline())
        assert _alive(server_pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 128 + signal.SIGTERM  # SystemExit(143): the launcher's finally ran
        deadline = time.monotonic() + 30
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(server_pid)
    finally:
        if proc.poll() is None:
            proc.kill()
