"""Runs the real `pdserve serve` in a subprocess on a free loopback port for end-to-end tests.

The server starts its own local Ray cluster; stopping it with SIGTERM exercises the drain path, and the test
fails if it does not exit in time (then it is killed, so nothing is left running).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from benchclient.launcher import LaunchedServer, launched_server

START_TIMEOUT_S = 180
STOP_TIMEOUT_S = 60
HALF_CPU = {"num_cpus": 0.5, "kv_cache_memory_bytes": 64 << 20}  # two workers share one of CI's 2 cores
ADMIN_KEY = "pdserve-test-operator"  # every test server's operator key (server.admin_api_key)
OPERATOR = {"Authorization": f"Bearer {ADMIN_KEY}"}  # the headers of an operator's request


@contextmanager
def running_server(tmp_path: Path, config: dict) -> Iterator[LaunchedServer]:
    """`pdserve serve` on a free loopback port (benchclient's launcher); the test fails unless it drains and
    exits with status 0 on SIGTERM."""
    config = {**config, "server": {"admin_api_key": ADMIN_KEY, **config.get("server", {}), "host": "127.0.0.1",
                                   "port": None}}
    with launched_server(config, tmp_path, START_TIMEOUT_S, STOP_TIMEOUT_S) as server:
        yield server


def worker_pids(server: LaunchedServer, role: str | None = None) -> list[int]:
    """PIDs of this server's worker actors (descendants of the server process only, so other Ray clusters on the
    machine are never touched); with `role`, only those /health names as that role's ("prefill", "decode",
    "collocated")."""
    named = None
    if role is not None:
        named = {w["pid"] for w in httpx.get(f"{server.url}/health", headers=OPERATOR, timeout=10).json()["workers"]
                 if w["role"] == role}
    return [pid for pid in server_processes(server, "ray::Worker") if named is None or pid in named]


def idle_ray_processes(server: LaunchedServer) -> list[int]:
    """PIDs of this server's Ray worker processes that host nothing yet (`ray::IDLE`: started ahead,
    coordinator.backend.warm_processes)."""
    return server_processes(server, "ray::IDLE")


def server_processes(server: LaunchedServer, marker: str) -> list[int]:
    """PIDs of the server's descendants whose command line holds `marker`."""
    table = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    parent, args = {}, {}
    for line in table.splitlines():
        pid, ppid, *cmd = line.split(None, 2)
        parent[int(pid)], args[int(pid)] = int(ppid), " ".join(cmd)

    def descends(pid: int) -> bool:
        while pid > 1:
            if pid == server.pid:
                return True
            pid = parent.get(pid, 0)
        return False
    return [pid for pid, cmd in args.items() if marker in cmd and descends(pid)]


def frontend_pids(server_pid: int) -> dict[int, int]:
    """{index: pid} of a server's HTTP frontend processes (`server.api_processes` > 1: children of its core process,
    coordinator.frontends, which is itself a child of `pdserve serve`'s supervisor); empty for a one-process
    server."""
    parent, cmds = {}, {}
    for entry in Path("/proc").iterdir():
        try:
            cmds[int(entry.name)] = (entry / "cmdline").read_bytes().split(b"\0")
            parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == server_pid:
                return True
        return False
    return {int(cmd[cmd.index(b"--index") + 1]): pid for pid, cmd in cmds.items()
            if b"coordinator.frontends.main" in cmd and descends(pid)}


def tp_followers(actor_pid: int) -> list[int]:
    """A tensor-parallel worker's follower processes: its spawned children (not multiprocessing's tracker)."""
    table = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in table.splitlines()]
    return [int(pid) for pid, ppid, *cmd in rows if int(ppid) == actor_pid and "spawn_main" in " ".join(cmd)]


def live_worker_pids(server: LaunchedServer, role: str) -> dict[str, int]:
    """{worker name: pid} of the live `role` workers, from /health (checked against the process table)."""
    workers = {w["name"]: w["pid"] for w in httpx.get(f"{server.url}/health", headers=OPERATOR,
                                                      timeout=10).json()["workers"]
               if w["role"] == role and w["state"] == "live"}
    assert set(workers.values()) <= set(worker_pids(server))
    return workers


def busiest_worker(url: str, role: str, names: list[str]) -> str | None:
    """Which of `names` holds the most booked KV blocks now (the coordinator's own ledger, one /metrics read);
    None while none holds any."""
    booked = metric_values(url, "pdserve_worker_booked_kv_blocks")
    holding = {name: booked.get(f'{{worker="{name}",role="{role}"}}', 0) for name in names}
    return max(holding, key=holding.get) if any(holding.values()) else None


class LabelSets(dict):
    """{labels text: value}, looked up by label set: '{a="1",b="2"}' and '{b="2",a="1"}' are the same key
    (Prometheus compares label sets; prometheus_client prints label names sorted)."""

    def __init__(self, items: dict[str | None, float]) -> None:
        super().__init__({_canonical(k): v for k, v in items.items()})

    def __getitem__(self, key: str | None) -> float:
        return super().__getitem__(_canonical(key))

    def __contains__(self, key: object) -> bool:
        return super().__contains__(_canonical(key) if isinstance(key, str) else key)

    def get(self, key: str | None, default: float | None = None) -> float | None:  # type: ignore[override]
        return super().get(_canonical(key), default)


def _canonical(labels: str | None) -> str | None:
    if not labels:
        return labels
    pairs = re.findall(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"', labels)
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(pairs)) + "}"


def scrape(url: str) -> str:
    """The server's /metrics text, as the operator reads it (with the tenant-labelled families)."""
    request = urllib.request.Request(f"{url}/metrics", headers=OPERATOR)
    with urllib.request.urlopen(request, timeout=10) as r:  # no client to build: quick under load
        return r.read().decode()


def values_in(text: str, name: str) -> LabelSets:
    """{labels text: value} of one metric family in a /metrics text, keyed by label set (any label order finds
    it)."""
    return LabelSets({m.group(1): float(m.group(2))
                      for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)})


def metric_values(url: str, name: str) -> LabelSets:
    """values_in(one scrape of url, name)."""
    return values_in(scrape(url), name)


async def complete(client: httpx.AsyncClient, url: str, body: dict,
                   on_chunk: Callable[[int], None] | None = None) -> dict:
    """POST a completion; for streams, reassemble text, token count and finish reason from the SSE chunks
    (`on_chunk(n)` is called with the number of chunks received so far); `token_ids` with return_token_ids."""
    if not body.get("stream"):
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        return {"text": data["choices"][0]["text"], "finish_reason": data["choices"][0]["finish_reason"],
                "completion_tokens": data["usage"]["completion_tokens"],
                "token_ids": data["choices"][0].get("token_ids")}
    body = {**body, "stream_options": {"include_usage": True}}
    text, finish, usage, received, ids = [], None, None, 0, []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, (r.status_code, (await r.aread()).decode()[:2000])
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            received += 1
            if on_chunk is not None:
                on_chunk(received)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text.append(choice["text"])
                ids += choice.get("token_ids") or []
                finish = choice["finish_reason"] or finish
    return {"text": "".join(text), "finish_reason": finish, "completion_tokens": usage["completion_tokens"],
            "token_ids": ids if body.get("return_token_ids") else None}



def leaver(prompt: list[int], max_tokens: int = 40) -> dict:
    """The completion body of a `tiny` client that leaves mid-way (stream_until, leave_after_s)."""
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}


async def stream_until(client: httpx.AsyncClient, url: str, body: dict, chunks: float) -> int:
    """Read `chunks` SSE events of a streamed completion (inf: all of them), then drop the connection (a client that
    leaves). Returns the events read; no event may carry an error."""
    seen = 0
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                assert '"error"' not in line, line
                seen += 1
                if seen >= chunks:
                    break
    return seen


async def leave_after_s(client: httpx.AsyncClient, url: str, body: dict, after_s: float) -> None:
    """A client that gives up `after_s` into its streamed completion, whatever phase it is in."""
    task = asyncio.ensure_future(stream_until(client, url, body, float("inf")))
    await asyncio.sleep(after_s)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def streams_with_a_kill(url: str, bodies: list[dict], kill: Callable[[], Awaitable[None]], stream=None,
                        after_chunks: int = 3, timeout_s: float = 300.0) -> list[dict]:
    """Runs every body as a stream (`stream(client, url, body, on_chunk)`, default `complete`) and awaits `kill()`
    once every stream has received `after_chunks` chunks (all decoding: a fixed delay would let fast machines
    finish first). The streams' results, in order."""
    stream = stream or complete
    started: list[int] = []
    decoding = asyncio.Event()

    def progress(chunks: int) -> None:
        if chunks == after_chunks:
            started.append(1)
            if len(started) == len(bodies):
                decoding.set()

    async def killer() -> None:
        await decoding.wait()
        await kill()

    async def run() -> list:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            return await asyncio.gather(killer(), *[stream(client, url, b, progress) for b in bodies])
    _, *results = asyncio.run(asyncio.wait_for(run(), timeout_s))
    return results


async def admin_kill(url: str, worker: str, rank: int | None = None) -> None:
    """POST /admin/workers/{worker}/kill[?rank=r] (needs server.admin_api), from a thread with a plain HTTP
    request: a new httpx client builds an SSL context, which under CI load blocked the streams' event loop for up
    to half a second (their client-side latencies grew, and short streams finished before the kill)."""
    def post() -> int:
        query = "" if rank is None else f"?rank={rank}"
        request = urllib.request.Request(f"{url}/admin/workers/{worker}/kill{query}", method="POST", headers=OPERATOR)
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status
    assert await asyncio.to_thread(post) == 200

IDLE_TIMEOUT_S = 20.0


def poll(what: Callable[[], object], deadline_s: float, interval_s: float = 0.2) -> object:
    """`what()` again and again until it is truthy or `deadline_s` has passed: its last value (tests assert on what
    it found, never on how long it took)."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = what()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def wait_for_idle_workers(url: str, timeout_s: float = IDLE_TIMEOUT_S) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        free = metric_values(url, "pdserve_worker_free_blocks")
        total = metric_values(url, "pdserve_worker_total_blocks")
        if free == total and len(free) > 0:
            return free
        if time.monotonic() > deadline:
            raise AssertionError(f"workers hold blocks after {timeout_s} s: free {free}, total {total}")
        time.sleep(0.25)


def wait_for_health(url: str, code: int, timeout_s: float = 120.0) -> dict:
    """Poll /health until it answers `code`; its JSON body."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(f"{url}/health", timeout=10)
        if r.status_code == code:
            return r.json()
        if time.monotonic() > deadline:
            raise AssertionError(f"/health still {r.status_code} after {timeout_s} s: {r.text}")
        time.sleep(0.1)


def admin_integrity(url: str) -> dict:
    """GET /admin/integrity (needs server.admin_api) with the operator's key: the coordinator's bookings and every
    engine's blocks."""
    r = httpx.get(f"{url}/admin/integrity", timeout=30, headers=OPERATOR)
    assert r.status_code == 200, r.text
    return r.json()


def assert_nothing_booked(url: str) -> dict:
    """Once the workers are idle: integrity holds, the coordinator books nothing and no engine holds a block in
    use or pinned (needs server.admin_api). Returns the integrity report. The load metrics lag a poll behind, so
    idle means: the engines report nothing in use or pinned, for up to `IDLE_TIMEOUT_S` (a leak stays)."""
    wait_for_idle_workers(url)
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        integrity = admin_integrity(url)
        held = [c for c in integrity["workers"].values() if c["in_use"] or c["pinned"]]
        if not held or not integrity["ok"] or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert integrity["ok"], integrity
    assert all(v == 0 for kinds in integrity["coordinator"].values() for v in kinds.values()), integrity
    for name, counts in integrity["workers"].items():
        assert counts["in_use"] == 0 and counts["pinned"] == 0, (name, counts)
    booked = metric_values(url, "pdserve_worker_booked_kv_blocks")
    assert booked and all(v == 0 for v in booked.values()), booked
    assert poll(lambda: not any(requests_in_flight(url)), IDLE_TIMEOUT_S), \
        f"requests still counted in flight (drain tickets, tenants' charges): {requests_in_flight(url)}"
    return integrity


def requests_in_flight(url: str) -> list[float]:
    """What the HTTP side counts in flight: the drain's admitted requests, then every tenant's (a request that ended
    and still counts holds a stop for its drain timeout and a place in its tenant's limits)."""
    text = scrape(url)
    return [*values_in(text, "pdserve_requests_in_flight").values(),
            *values_in(text, "pdserve_tenant_in_flight").values()]


def streamed_chunks(url: str, body: dict, key: str | None = None) -> tuple[list[int], str]:
    """Tokens per SSE chunk (counted from the chunks' logprob entries) and the text of one streamed completion."""
    counts, text = [], ""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True, "logprobs": 0},
                      headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                counts.append(len(choice["logprobs"]["tokens"]))
                text += choice["text"]
    return counts, text
