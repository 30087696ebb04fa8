"""The coordinator restarts without losing the fleet, on the real server (`pdserve serve`, local Ray, the embedded
`tiny` model, UCX between 1 prefill + 1 decode worker): SIGKILL of the coordinator process mid-stream ends the
clients' streams with an error (not a hang), the process supervisor starts it again by itself, and the new one adopts
the same worker processes (no second model load, the orphaned requests aborted, integrity clean) and serves exactly
the engine's greedy outputs; a worker killed while no coordinator runs is replaced after the adoption; `pdserve stop`
stops it all, no worker left. On a joined Ray cluster: a whole server SIGKILLed and started again adopts its workers,
one started with another pool config replaces them, and `pdserve stop` empties the namespace a killed one left.
Prints the time from the kill to the first request served (docs/operations.md)."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from coordinator.backend.fleet import actor_name, fingerprint, parse_actor_name
from coordinator.config.serve_config import PoolConfig, ServeConfig
from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts
from tests.server_process import (
    ADMIN_KEY,
    HALF_CPU,
    OPERATOR,
    admin_integrity,
    assert_nothing_booked,
    complete,
    live_worker_pids,
    poll,
    running_server,
)

pytestmark = pytest.mark.timeout(900)
VOCAB = 2000
DEADLINE_S = 180.0  # generous bound for polled states on a loaded 2-core machine (never a measured duration)
CONFIG = {"model": "tiny", "prefill": HALF_CPU, "decode": HALF_CPU, "transfer": {"backends": ["ucx"]},
          "admission": {"timeout_s": 120}, "recovery": {"backoff_initial_s": 0.2}, "server": {"admin_api": True}}


def _body(prompt: list[int], max_tokens: int, stream: bool) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def _expected(bodies: list[dict]) -> list[str]:
    reference = LLM("tiny")
    return [reference.generate([b["prompt"]], SamplingParams(temperature=0, max_tokens=b["max_tokens"],
                                                             ignore_eos=True))[0].text for b in bodies]


def _coordinator_pid(server_pid: int) -> int | None:
    """The coordinator process under `pdserve serve`'s supervisor (`coordinator.cli _coordinator`), or None."""
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(stat[1]) == server_pid and b"_coordinator" in cmd and stat[0] not in ("Z", "X"):
            return int(entry.name)
    return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _serving(url: str) -> bool:
    """/health says 200 (a request that waits in the backlog of a coordinator still starting times out: False)."""
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code == 200
    except httpx.TransportError:
        return False


def _log(tmp_path: Path) -> str:
    return (tmp_path / "server.log").read_text(errors="replace")


def _streams_cut_by(url: str, bodies: list[dict], kill) -> list[BaseException | dict]:
    """Every body as a stream; once each has 3 chunks, `kill()`; what each stream ended with (its result or the
    error it raised)."""
    async def run() -> list:
        started, decoding = [], asyncio.Event()

        def progress(chunks: int) -> None:
            if chunks == 3:
                started.append(1)
                if len(started) == len(bodies):
                    decoding.set()
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            tasks = [asyncio.create_task(complete(client, url, b, progress)) for b in bodies]
            await asyncio.wait_for(decoding.wait(), DEADLINE_S)
            kill()
            return await asyncio.gather(*tasks, return_exceptions=True)
    return asyncio.run(run())


def _first_served_after_kill(url: str, body: dict) -> tuple[dict, float]:
    """One completion sent right after the kill (it waits in the listening socket's backlog for the next
    coordinator, or gets a 503 while the pools are not all live: then it is sent again); the result and the seconds
    from the kill to its answer."""
    killed = time.monotonic()
    with httpx.Client(timeout=DEADLINE_S) as client:
        while True:
            try:
                r = client.post(f"{url}/v1/completions", json=body)
            except httpx.TransportError:
                r = None  # the dying coordinator's connection
            if r is not None and r.status_code == 200:
                return r.json(), time.monotonic() - killed
            assert time.monotonic() - killed < DEADLINE_S, r.text if r is not None else "no answer"
            time.sleep(0.05)


def test_a_killed_coordinator_comes_back_and_adopts_its_workers(tmp_path):
    cut = [_body(p, 1500, True) for p in random_prompts([9, 17, 26], VOCAB, seed=61)]
    later = [_body(p, 24, False) for p in random_prompts([5, 12, 40, 33], VOCAB, seed=62)]
    wanted = _expected(later)
    with running_server(tmp_path, CONFIG) as server:
        url = server.url
        before = {role: live_worker_pids(server, role) for role in ("prefill", "decode")}
        first = _coordinator_pid(server.pid)
        assert b"_coordinator" in Path(f"/proc/{first}/cmdline").read_bytes()  # pdserve serve's coordinator child

        ended = _streams_cut_by(url, cut, lambda: os.kill(first, signal.SIGKILL))
        served, seconds = _first_served_after_kill(url, later[0])
        print(f"\ncoordinator SIGKILLed -> first request served: {seconds:.2f} s (CPU, 1P+1D tiny)")

        # every stream in flight ended with an error on the client's side (the connection dropped), none hung
        assert all(isinstance(e, httpx.TransportError) for e in ended), ended
        second = _coordinator_pid(server.pid)
        assert second is not None and second != first
        assert poll(lambda: _serving(url), DEADLINE_S)
        # the same worker processes, adopted: no model loaded again (one "ready" line per worker: the first start)
        assert {role: live_worker_pids(server, role) for role in ("prefill", "decode")} == before
        log = _log(tmp_path)
        assert log.count(" ready: schedule ") == 2, log[-3000:]
        assert "worker prefill-0 adopted" in log and "worker decode-0 adopted" in log
        assert "the coordinator (pid" in log and "starting it again" in log
        aborted = sum(int(line.split("): ")[1].split()[0]) for line in log.splitlines() if " adopted (" in line)
        assert aborted >= 1, log[-3000:]  # the cut streams' requests, still decoding there, were aborted
        assert admin_integrity(url)["ok"]

        async def rest() -> list[dict]:
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                return await asyncio.gather(*[complete(client, url, b) for b in later[1:]])
        results = [{"text": served["choices"][0]["text"]}, *asyncio.run(rest())]
        assert [r["text"] for r in results] == wanted
        assert_nothing_booked(url)  # the orphans' blocks are free: nothing in use or pinned on either worker

        # a worker killed while no coordinator runs: the adoption replaces its slot (a definite state)
        coordinator = _coordinator_pid(server.pid)
        os.kill(coordinator, signal.SIGKILL)
        os.kill(before["decode"]["decode-0"], signal.SIGKILL)
        assert poll(lambda: _coordinator_pid(server.pid) not in (None, coordinator), DEADLINE_S)
        assert poll(lambda: _serving(url), DEADLINE_S)
        after = poll(lambda: live_worker_pids(server, "decode"), DEADLINE_S)
        assert set(after) == {"decode-0"} and after["decode-0"] != before["decode"]["decode-0"], after
        assert live_worker_pids(server, "prefill") == before["prefill"]  # adopted again
        again = asyncio.run(_all(url, later))
        assert [r["text"] for r in again] == wanted
        assert_nothing_booked(url)

        # pdserve stop: the supervisor drains and exits, the workers with it
        workers = [*live_worker_pids(server, "prefill").values(), *after.values()]
        stop = subprocess.run([sys.executable, "-m", "coordinator.cli", "stop", str(tmp_path / "serve.yaml")],
                              capture_output=True, text=True, timeout=DEADLINE_S)
        assert stop.returncode == 0, stop.stderr
        assert "stopped the server" in stop.stdout
        assert poll(lambda: not _alive(server.pid), DEADLINE_S)
        assert poll(lambda: not any(_alive(pid) for pid in workers), DEADLINE_S), workers


async def _all(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
        return await asyncio.gather(*[complete(client, url, b) for b in bodies])


def test_fleet_names_and_fingerprints():
    assert parse_actor_name(actor_name("decode", 3, 7)) == ("decode", 3, 7)
    assert parse_actor_name("someone-else") is None and parse_actor_name("decode-1") is None
    base = ServeConfig()
    pools = ("prefill", "decode")
    same = fingerprint(base, pools)
    # the coordinator's own settings may change across a restart; what the workers were started with may not
    from dataclasses import replace
    assert fingerprint(replace(base, server=replace(base.server, port=1234)), pools) == same
    assert fingerprint(replace(base, recovery=replace(base.recovery, max_migrations=9)), pools) == same
    assert fingerprint(replace(base, decode=PoolConfig(workers=2, max_num_seqs=256)), pools) != same
    assert fingerprint(replace(base, model="elsewhere"), pools) != same


def _serve(config_path: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "coordinator.cli", "serve", str(config_path)],
                            stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _pids(url: str) -> dict[str, int]:
    workers = httpx.get(f"{url}/health", headers=OPERATOR, timeout=10).json()["workers"]
    return {w["name"]: w["pid"] for w in workers}


def test_on_a_joined_cluster_a_whole_server_restart_adopts_a_changed_config_replaces_and_stop_empties(tmp_path):
    """`ray_address` set: the workers are the cluster's, not the server's processes. SIGKILL of the whole
    `pdserve serve` leaves them in the namespace; the next `pdserve serve` with the same config adopts them (same
    pids), one with another pool config tears them down and starts its own; `pdserve stop` with no server running
    removes what a killed one left: the namespace ends empty."""
    import ray
    import yaml

    from benchclient.launcher import free_port
    ray.init(include_dashboard=False, num_cpus=2, logging_level="WARNING")
    procs: list[subprocess.Popen] = []
    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        config = {**CONFIG, "ray_address": ray.get_runtime_context().gcs_address,
                  "server": {**CONFIG["server"], "admin_api_key": ADMIN_KEY, "port": port}}
        path, log = tmp_path / "serve.yaml", tmp_path / "server.log"
        path.write_text(yaml.safe_dump(config))

        def start() -> subprocess.Popen:
            procs.append(_serve(path, log))
            assert poll(lambda: _serving(url), DEADLINE_S), log.read_text()[-3000:]
            return procs[-1]

        def kill(server: subprocess.Popen) -> None:
            """SIGKILL of the whole server: the supervisor (its watchdog then kills the coordinator)."""
            coordinator = _coordinator_pid(server.pid)
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
            assert poll(lambda: not _alive(coordinator), DEADLINE_S)  # the port is free again

        def ours() -> list[str]:
            return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["namespace"].startswith("pdserve-") and a["namespace"].endswith(f"-{port}")]

        first = start()
        pids = _pids(url)
        kill(first)
        assert sorted(ours()) == ["decode-0@0", "prefill-0@0"]  # left running in the cluster
        assert all(_alive(pid) for pid in pids.values())

        second = start()  # the same config: adopted, no model loaded again
        assert _pids(url) == pids
        assert log.read_text().count(" ready: schedule ") == 2
        kill(second)

        path.write_text(yaml.safe_dump({**config, "decode": {**HALF_CPU, "max_num_seqs": 32}}))
        third = start()  # another decode config: the old fleet is torn down, a new one started
        assert "were started for another config" in log.read_text()
        fresh = _pids(url)
        assert not set(fresh.values()) & set(pids.values()), (fresh, pids)
        assert poll(lambda: not any(_alive(pid) for pid in pids.values()), DEADLINE_S)
        kill(third)

        stop = subprocess.run([sys.executable, "-m", "coordinator.cli", "stop", str(path)], capture_output=True,
                              text=True, timeout=DEADLINE_S)
        assert stop.returncode == 0, stop.stderr
        assert "removed 2 workers" in stop.stdout, stop.stdout
        assert poll(lambda: not ours(), DEADLINE_S), ours()
        assert poll(lambda: not any(_alive(pid) for pid in fresh.values()), DEADLINE_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        ray.shutdown()
