"""Worker loss with a live worker of the other pool (`pdserve serve`, local Ray, 1 prefill + 1 decode, UCX): when the
only decode worker is SIGKILLed under 16 streams, the streams go on whole on the prefill worker (admission's
fallback) without waiting for a replacement, with exactly the output of an uninterrupted run (greedy and seeded); new
requests are served there too; once the slot is live again, new work is split again. The slot here cannot come back
by itself (`recovery.max_restarts: 0`: it gives up at once), so every stream that finishes did so before any
replacement was live: the order of events is the test's, not the machine's speed. An operator's revive brings it
back."""

import asyncio
import os
import signal

import httpx
import pytest

from tests.engine_helpers import random_prompts
from tests.server_process import (
    HALF_CPU,
    OPERATOR,
    admin_integrity,
    complete,
    metric_values,
    poll,
    running_server,
    streams_with_a_kill,
    wait_for_health,
    wait_for_idle_workers,
    worker_pids,
)
from tests.test_self_healing import _bodies, _expected, _faults

pytestmark = pytest.mark.timeout(500)
TOKENS = 96
DEADLINE_S = 60.0  # a generous bound for polled states on a loaded machine (never a measured duration)


def _health(url: str) -> dict[str, dict]:
    return {w["name"]: w for w in httpx.get(f"{url}/health", headers=OPERATOR, timeout=10).json()["workers"]}


def _fallbacks(url: str) -> float:
    return metric_values(url, "pdserve_fallback_placements_total").get('{missing="decode"}', 0.0)


def _routed(url: str, name: str, role: str) -> float:
    return metric_values(url, "pdserve_worker_requests_routed").get(f'{{worker="{name}",role="{role}"}}', 0.0)


def test_the_only_decode_worker_killed_streams_go_on_whole_on_the_prefill_worker(tmp_path, reference, llama):
    config = {"model": str(llama), "prefill": {**HALF_CPU, "chunk_size": 16}, "decode": HALF_CPU,
              "transfer": {"backends": ["ucx"]}, "recovery": {"max_restarts": 0}, "admission": {"timeout_s": 120},
              "server": {"admin_api": True}}
    bodies = _bodies(llama, random_prompts([12 + 5 * i for i in range(16)], 2000, seed=41), max_tokens=TOKENS)
    expected = _expected(reference, bodies)
    later = _bodies(llama, random_prompts([17, 40], 2000, seed=42), max_tokens=12)
    expected_later = _expected(reference, later)
    with running_server(tmp_path, config) as server:
        url = server.url
        # decode-0 steps at >= 20 ms and its pid is looked up ahead: the streams cannot all end before the kill
        # lands (on a loaded CI machine they once did, and nothing was left to move)
        _faults(url, {"slow_step_s": 0.02, "slow_workers": ["decode-0"]})
        pids = worker_pids(server, "decode")
        assert len(pids) == 1, pids
        decoding, started = asyncio.Event(), []

        def progress(chunks: int) -> None:
            if chunks == 2:  # its first token from the decode worker: half the streams decoding, then the kill
                started.append(1)
                if len(started) == len(bodies) // 2:
                    decoding.set()

        async def kill() -> None:
            await decoding.wait()
            os.kill(pids[0], signal.SIGKILL)

        async def run() -> list[dict]:
            async with httpx.AsyncClient(timeout=300) as client:
                _, *results = await asyncio.gather(kill(), *[complete(client, url, b, progress) for b in bodies])
            return results
        results = asyncio.run(asyncio.wait_for(run(), 300))
        for got, want in zip(results, expected, strict=True):
            assert (got["text"], got["completion_tokens"], got["finish_reason"]) == (want, TOKENS, "length")
        # every stream finished, and the decode slot was never live again meanwhile: they finished on prefill-0
        assert _health(url)["decode-0"]["state"] == "failed"
        moved = metric_values(url, "pdserve_migrations_total")
        assert moved['{event="attempted"}'] >= 1 and moved.get('{event="outcome_failed"}', 0) == 0, moved
        assert _fallbacks(url) >= moved['{event="attempted"}'], (_fallbacks(url), moved)

        # a new request while the decode pool is down: whole on prefill-0 as well
        before = _fallbacks(url)
        got = asyncio.run(_one(url, later[0]))
        assert got["text"] == expected_later[0]
        assert _fallbacks(url) == before + 1
        prefill = '{role="prefill",worker="prefill-0"}'  # (decode-0 is down: it reports no free blocks)
        assert poll(lambda: metric_values(url, "pdserve_worker_free_blocks").get(prefill)
                    == metric_values(url, "pdserve_worker_total_blocks")[prefill], DEADLINE_S)
        integrity = admin_integrity(url)
        assert integrity["ok"] and integrity["workers"]["prefill-0"]["in_use"] == 0, integrity

        # the operator revives the slot: once it is live, new work is split again (prefill-0 -> decode-0)
        r = httpx.post(f"{url}/admin/workers/decode-0/revive", headers=OPERATOR, timeout=30)
        assert r.status_code == 200, r.text
        wait_for_health(url, 200, timeout_s=180)
        routed = _routed(url, "decode-0", "decode")
        got = asyncio.run(_one(url, later[1]))
        assert got["text"] == expected_later[1]
        assert _fallbacks(url) == before + 1 and _routed(url, "decode-0", "decode") == routed + 1
        wait_for_idle_workers(url)
        integrity = admin_integrity(url)
        assert integrity["ok"] and all(v == 0 for kinds in integrity["coordinator"].values()
                                       for v in kinds.values()), integrity


async def _one(url: str, body: dict) -> dict:
    async with httpx.AsyncClient(timeout=120) as client:
        return await complete(client, url, body)


def _spares(url: str) -> dict[str, dict]:
    return {w["name"]: w for w in httpx.get(f"{url}/health", headers=OPERATOR, timeout=10).json()["workers"]
            if w["state"] == "spare"}


def test_a_warm_spare_takes_over_the_killed_slot_and_a_new_spare_comes(tmp_path, reference, llama):
    """`recovery.spares: 1`: a spare per pool, started and loaded; the killed decode slot is taken over by the decode
    spare (the slot's new pid is the spare's), the streams finish exactly, and a new spare is started in its place."""
    config = {"model": str(llama), "prefill": HALF_CPU, "decode": HALF_CPU, "transfer": {"backends": ["ucx"]},
              "recovery": {"spares": 1, "backoff_initial_s": 0.1, "backoff_max_s": 1.0},
              "admission": {"timeout_s": 120}, "server": {"admin_api": True}}
    bodies = _bodies(llama, random_prompts([9 + 4 * i for i in range(16)], 2000, seed=43), max_tokens=TOKENS)
    expected = _expected(reference, bodies)
    with running_server(tmp_path, config) as server:
        url = server.url
        spares = poll(lambda: len(found := _spares(url)) == 2 and found, DEADLINE_S * 3)
        assert spares and {s["role"] for s in spares.values()} == {"prefill", "decode"}, spares
        spare = next(s for s in spares.values() if s["role"] == "decode")
        old = _health(url)["decode-0"]["pid"]

        async def kill() -> None:
            os.kill(old, signal.SIGKILL)
        results = streams_with_a_kill(url, bodies, kill, after_chunks=2)
        for got, want in zip(results, expected, strict=True):
            assert (got["text"], got["completion_tokens"], got["finish_reason"]) == (want, TOKENS, "length")
        slot = poll(lambda: (w := _health(url)["decode-0"])["state"] == "live" and w, DEADLINE_S)
        assert slot and slot["pid"] == spare["pid"] != old, (slot, spare, old)
        assert "takeover_s" in slot["last_recovery_s"], slot
        assert metric_values(url, "pdserve_spare_takeovers_total")['{pool="decode"}'] == 1
        refilled = poll(lambda: [s for s in _spares(url).values() if s["role"] == "decode"], DEADLINE_S * 3)
        assert refilled and refilled[0]["pid"] not in (old, spare["pid"]) and refilled[0]["name"] != spare["name"]
        assert metric_values(url, "pdserve_spares_ready") == {'{pool="prefill"}': 1, '{pool="decode"}': 1}
        _check_clean(url)


def _check_clean(url: str) -> None:
    wait_for_health(url, 200)
    wait_for_idle_workers(url)
    integrity = admin_integrity(url)
    assert integrity["ok"] and all(v == 0 for kinds in integrity["coordinator"].values()
                                   for v in kinds.values()), integrity
