"""Worker processes started ahead (coordinator.backend.warm_processes, `recovery.warm_processes`), on the real server
(`pdserve serve`, local Ray, 1 prefill + 1 decode over UCX, the embedded `tiny` model): once the pools are up one
idle Ray worker process waits on the node with pdserve's worker modules imported (pool_worker.preload); a killed
worker's replacement takes exactly that process (its start has no `schedule` or `process` phase: the process was
there before it was asked for), another one replaces it, and the server serves as before. With
`recovery.warm_processes: 0` nothing waits and a replacement spawns its own process. Where it cannot help (the RPC
fails, a job with a runtime_env), the keeper says so and never fails a start."""

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server_process import (
    HALF_CPU,
    OPERATOR,
    idle_ray_processes,
    poll,
    running_server,
    wait_for_health,
)

pytestmark = pytest.mark.timeout(400)
ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 120.0  # a generous bound for polled states on a loaded 2-core machine (never a measured duration)


def _config(warm: int) -> dict:
    return {"model": "tiny", "prefill": dict(HALF_CPU), "decode": dict(HALF_CPU), "transfer": {"backends": ["ucx"]},
            "recovery": {"warm_processes": warm, "backoff_initial_s": 0.1}, "server": {"admin_api": True}}


def _slot(url: str, name: str) -> dict:
    workers = httpx.get(f"{url}/health", headers=OPERATOR, timeout=10).json()["workers"]
    return next(w for w in workers if w["name"] == name)


def _kill_and_wait(url: str, name: str, restarts: int) -> dict:
    r = httpx.post(f"{url}/admin/workers/{name}/kill", headers=OPERATOR, timeout=30)
    assert r.status_code == 200, r.text
    slot = poll(lambda: (s := _slot(url, name))["state"] == "live" and s["restarts"] == restarts and s, DEADLINE_S)
    assert slot, f"{name} was not replaced: {_slot(url, name)}"
    wait_for_health(url, 200)
    return slot


def _one_idle(server) -> int:
    """The one idle process the node keeps, once its preload has begun (polled: it starts after the pools are up, or
    after a start took it). Its start phases say `process` 0 only if the worker's code began to import before the
    actor was asked for: a process that exists but has not begun its preload yet would not."""
    idle = poll(lambda: len(found := idle_ray_processes(server)) == 1 and _preloading(found[0]) and found,
                DEADLINE_S)
    assert idle, f"expected one idle worker process, preloading, found {idle_ray_processes(server)}"
    return idle[0]


def _preloading(pid: int) -> bool:
    """Whether process `pid` has begun pool_worker.preload: torch's library is mapped (the preload imports it, after
    pool_worker/__init__ stamped the import's start: pool_worker.start_phases)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_a_replacement_takes_the_process_started_ahead_and_another_replaces_it(tmp_path):
    with running_server(tmp_path, _config(1)) as server:
        url = server.url
        for name in ("decode-0", "prefill-0"):
            ready = _one_idle(server)
            slot = _kill_and_wait(url, name, 1)
            recovery = slot["last_recovery_s"]
            assert slot["pid"] == ready, (slot, ready)
            assert recovery["schedule_s"] == 0.0 and recovery["process_s"] == 0.0, recovery
        _one_idle(server)  # replaced again, and only one
        time.sleep(1.0)
        assert len(idle_ray_processes(server)) == 1
        body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 8, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text


def test_without_warm_processes_a_replacement_spawns_its_own(tmp_path):
    with running_server(tmp_path, _config(0)) as server:
        assert idle_ray_processes(server) == []
        slot = _kill_and_wait(server.url, "decode-0", 1)
        assert slot["last_recovery_s"]["schedule_s"] > 0.0, slot
        assert idle_ray_processes(server) == []


KEEPER_CHECKS = """
import logging, sys
import ray
from coordinator.backend.warm_processes import WarmProcesses
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
ray.init(num_cpus=1, include_dashboard=False, runtime_env=eval(sys.argv[1]) or None)
keeper = WarmProcesses(1)
keeper.prestart("ff" * 28, 1)  # a node id no raylet has
print("RESULT", keeper.available, repr(keeper.unavailable), keeper.requested)
ray.shutdown()
"""


@pytest.mark.parametrize("runtime_env", ["{}", "{'env_vars': {'PDSERVE_PROBE': '1'}}"])
def test_the_keeper_never_fails_a_start_and_says_why_it_cannot_help(runtime_env):
    """An unknown node (the RPC cannot be sent) is logged, never raised; a job with a runtime_env is refused at once
    with the reason (Ray would never hand its actors a process started without that runtime_env)."""
    out = subprocess.run([sys.executable, "-c", KEEPER_CHECKS, runtime_env], capture_output=True, text=True,
                         timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))
    if runtime_env == "{}":
        assert result == "RESULT True '' {}", out.stdout
        assert "could not start 1 worker process(es) ahead on node" in out.stdout, out.stdout
    else:
        assert result.startswith("RESULT False \"the job has a runtime_env (['env_vars'])"), out.stdout
        assert "no warm worker processes: the job has a runtime_env" in out.stdout, out.stdout


def test_the_first_workers_take_processes_started_ahead(tmp_path):
    """`pdserve serve` asks the raylet of the Ray it starts for its first workers' processes (at the raylet's
    registration, or once `ray.init` returns where that could not be done): each first worker's start has a handover
    and no schedule or process phase (it took a process started before it was asked for)."""
    config = {"model": "tiny", "mode": "collocated", "prefill": dict(HALF_CPU), "decode": dict(HALF_CPU)}
    with running_server(tmp_path, config) as server:
        workers = httpx.get(f"{server.url}/health", headers=OPERATOR, timeout=10).json()["workers"]
    for worker in workers:
        phases = worker["start_phases_s"]
        assert "handover" in phases and phases["schedule"] == 0.0 and phases["process"] == 0.0, worker


EARLY_PRESTART_ASKS = """
import time
from coordinator.backend.early_prestart import EarlyPrestart
early = EarlyPrestart(1)
early.start()
import ray
ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR",
         _system_config={"prestart_worker_first_driver": False})  # Ray starts none ahead by itself
early._thread.join(60)  # it finds the raylet registered (ray.init waited for that) and asks, or gives up
sent = early.finish()

@ray.remote(num_cpus=0)
class Probe:
    def created(self):
        from pool_worker.start_phases import process_created_at
        return process_created_at()

asked = time.time()
created = ray.get(Probe.remote().created.remote(), timeout=120)
print("RESULT", sent, created < asked)
ray.shutdown()
"""


def test_the_early_ask_reaches_the_raylet_of_the_ray_being_started():
    """coordinator.backend.early_prestart against a real local Ray: it finds this process's session, the GCS and the
    registered raylet, and asks for a process of no job; the next actor runs in that process, created before the
    actor was asked for."""
    out = subprocess.run([sys.executable, "-c", EARLY_PRESTART_ASKS], capture_output=True, text=True, timeout=240,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT True True" in out.stdout, (out.stdout, out.stderr[-3000:])


EARLY_PRESTART_STOPS = """
import time
from coordinator.backend.early_prestart import EarlyPrestart
early = EarlyPrestart(1)
early.start()  # no Ray starts in this process: its session folder never appears
time.sleep(0.3)
sent = early.finish()
early._thread.join(10)
print("RESULT", sent, early._thread.is_alive())
"""


def test_the_early_ask_stops_when_ray_init_is_done_without_it():
    """Where the raylet was not found before `ray.init` returned (here: no Ray at all), finish() says nothing was
    asked for (the caller asks then) and the watching thread ends."""
    out = subprocess.run([sys.executable, "-c", EARLY_PRESTART_STOPS], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT False False" in out.stdout, out.stdout
