"""Pools that scale, on the real server (`pdserve serve`, a local Ray cluster with room for exactly 4 workers: its
node offers 4 of a custom resource `pdserve_slot`, each worker takes one; the embedded `tiny` model; UCX between
workers; coordinator.backend.scaler). One prefill and one decode worker to start, the decode pool allowed 1 to 4:
a flood that misses a tight TPOT target grows the decode pool while every stream goes on to exactly the offline
engine's output, one worker at a time until the cluster is full (prefill 1 + decode 3); the next scale-out cannot be
placed and gives up saying so (its event's reason names the room it needed), and nothing hangs. When the flood ends
the pool shrinks back to min_workers, each removal a drain first: no request fails, nothing stays booked, and the
removed workers' processes are gone. /health's `scaling` is the operator's, read through one of two HTTP processes
(it crosses from the core process). Every step is awaited on what the server reports (/health's `scaling`,
/metrics), never on a measured time."""

import asyncio
import json
import os
from functools import partial

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts
from tests.server_process import (
    OPERATOR,
    assert_nothing_booked,
    complete,
    metric_values,
    poll,
    running_server,
    worker_pids,
)

pytestmark = pytest.mark.timeout(900)
VOCAB = 2000
DEADLINE_S = 400.0  # a generous bound on polled states on a loaded 2-core machine, never a measured duration
ROOM = 4            # workers the cluster has room for
STREAMS = 8         # the flood's concurrent streams
_poll = partial(poll, deadline_s=DEADLINE_S)
POOL = {"num_cpus": 0.25, "kv_cache_memory_bytes": 32 << 20, "kv_host_cache_bytes": 0,
        "resources": {"pdserve_slot": 1}}
CONFIG = {"model": "tiny", "prefill": POOL, "decode": {**POOL, "min_workers": 1, "max_workers": ROOM},
          # decode misses its TPOT target on any load on a CPU; prefill's TTFT target is never missed
          "slo": {"ttft_ms": 600_000, "tpot_ms": 1},
          "scaling": {"window_s": 5, "min_requests": 4, "cooldown_s": 1, "scale_in_after_s": 2, "scale_in_busy": 0.3,
                      "placement_timeout_s": 30},
          "transfer": {"backends": ["ucx"]}, "admission": {"timeout_s": 120},
          "server": {"admin_api": True, "api_processes": 2}}  # /health's scaling crosses from the core process


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server, its local Ray node offering ROOM `pdserve_slot`s (RAY_OVERRIDE_RESOURCES: how Ray's autoscaler
    sets a node's resources; read by the Ray the server starts)."""
    saved = os.environ.get("RAY_OVERRIDE_RESOURCES")
    os.environ["RAY_OVERRIDE_RESOURCES"] = json.dumps({"pdserve_slot": ROOM})
    try:
        with running_server(tmp_path_factory.mktemp("scaling"), CONFIG) as running:
            yield running
    finally:
        if saved is None:
            os.environ.pop("RAY_OVERRIDE_RESOURCES", None)
        else:
            os.environ["RAY_OVERRIDE_RESOURCES"] = saved


def _scaling(url: str) -> dict:
    return httpx.get(f"{url}/health", headers=OPERATOR, timeout=10).json()["scaling"]


def _events(url: str, direction: str) -> list[dict]:
    return [e for e in _scaling(url)["events"] if e["direction"] == direction]


def _body(prompt: list[int]) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}


def test_a_flood_grows_the_short_pool_until_the_cluster_is_full_and_the_quiet_shrinks_it_by_draining(server):
    url = server.url
    bodies = [_body(p) for p in random_prompts([6 + 5 * i for i in range(STREAMS)], VOCAB, seed=45)]
    reference = LLM("tiny")
    wanted = [reference.generate([b["prompt"]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].text
              for b in bodies]
    assert _scaling(url)["pools"] == {"decode": {"workers": 1, "live": 1, "min_workers": 1, "max_workers": ROOM}}
    assert "scaling" not in httpx.get(f"{url}/health", timeout=10).json()  # the operator's to read

    async def flood() -> list[tuple[int, str]]:
        """STREAMS streams at a time, each sending its body again as it ends, until a scale-out found no room."""
        full = asyncio.Event()
        results: list[tuple[int, str]] = []

        async def watch() -> None:
            while not _events(url, "out_failed"):
                await asyncio.sleep(0.5)
            full.set()

        async def stream(i: int, client: httpx.AsyncClient) -> None:
            while not full.is_set():
                results.append((i, (await complete(client, url, bodies[i]))["text"]))
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            await asyncio.wait_for(asyncio.gather(watch(), *[stream(i, client) for i in range(STREAMS)]), DEADLINE_S)
        return results
    results = asyncio.run(flood())

    # every stream of the flood ended with exactly the offline engine's greedy output
    assert results and all(text == wanted[i] for i, text in results), [i for i, t in results if t != wanted[i]]
    grown = _events(url, "out")
    # one at a time, up to the cluster's room (every event shown: a scale-out that failed says why)
    assert [e["worker"] for e in grown] == ["decode-1", "decode-2"], _scaling(url)["events"]
    assert all(e["pool"] == "decode" and "the decode pool misses its target: " in e["reason"] for e in grown), grown
    failed = _events(url, "out_failed")[0]
    assert failed["pool"] == "decode" and "the Ray cluster has no room for it" in failed["reason"], failed
    assert "'pdserve_slot': 1" in failed["reason"] and "no autoscaler" in failed["reason"], failed
    health = httpx.get(f"{url}/health", headers=OPERATOR, timeout=10).json()
    assert sorted(w["name"] for w in health["workers"]) == ["decode-0", "decode-1", "decode-2", "prefill-0"]
    assert all(w["state"] == "live" for w in health["workers"]), health["workers"]
    events = metric_values(url, "pdserve_pool_scale_events_total")
    assert events['{pool="decode",direction="out"}'] == 2, events
    assert events['{pool="decode",direction="out_failed"}'] >= 1, events

    # the load stopped: the pool shrinks back to min_workers, each worker drained and removed
    assert _poll(lambda: _scaling(url)["pools"]["decode"]["workers"] == 1), _scaling(url)
    # a slot leaves the pool when its removal begins; its event comes once the worker has stopped (seconds later on
    # a loaded machine)
    assert _poll(lambda: len(_events(url, "in")) >= 2), _scaling(url)["events"]
    shrunk = _events(url, "in")
    assert len(shrunk) == 2 and all("drained and removed" in e["reason"] for e in shrunk), shrunk
    assert sorted(e["worker"] for e in shrunk) == ["decode-1", "decode-2"], shrunk
    assert metric_values(url, "pdserve_pool_scale_events_total")['{pool="decode",direction="in"}'] == 2
    assert sorted(w["name"] for w in httpx.get(f"{url}/health", timeout=10).json()["workers"]) == \
        ["decode-0", "prefill-0"]
    assert _poll(lambda: len(worker_pids(server)) == 2), worker_pids(server)  # the removed workers' processes ended

    outcomes = metric_values(url, "pdserve_requests_total")
    assert outcomes.get('{outcome="failed"}', 0) == 0 and outcomes.get('{outcome="aborted"}', 0) == 0, outcomes
    assert outcomes['{outcome="finished"}'] == len(results)
    integrity = httpx.get(f"{url}/admin/integrity", headers=OPERATOR, timeout=30).json()
    assert integrity["ok"], integrity
    assert sorted(integrity["workers"]) == ["decode-0", "prefill-0"]
    assert_nothing_booked(url)

    # the pool that served a flood still serves, on the worker it kept
    async def again() -> list[dict]:
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            return await asyncio.gather(*[complete(client, url, b) for b in bodies[:3]])
    assert [r["text"] for r in asyncio.run(again())] == wanted[:3]
