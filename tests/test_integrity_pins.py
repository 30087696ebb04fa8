"""/admin/integrity against what the workers hold (coordinator.backend.block_audit), on the real server (`pdserve
serve`, local Ray, 1 prefill + 1 decode over UCX, the embedded `tiny` model, a short transfer.pin_lease_s):
requests aborted in every phase (in prefill, right after their first token, mid-decode) leave no pin for a lease to
free, and integrity stays ok; KV transfers stalled past the lease leave pins the lease must free, and integrity
reports that mismatch (instead of ok), then is ok again once the stall is over."""

import asyncio
import contextlib
import time

import httpx
import pytest

from tests.engine_helpers import random_prompts
from tests.server_process import (
    HALF_CPU,
    OPERATOR,
    admin_integrity,
    assert_nothing_booked,
    metric_values,
    running_server,
    stream_until,
    wait_for_idle_workers,
)

pytestmark = pytest.mark.timeout(400)
VOCAB = 2000
LEASE_S = 5.0  # transfer.pin_lease_s: short, so a leaked pin is freed (and counted) soon; far above a CPU handoff
DEADLINE_S = 180.0  # generous bound for polled states on a loaded 2-core machine (never a measured duration)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = {"model": "tiny", "prefill": {**HALF_CPU, "chunk_size": 256, "kv_cache_memory_bytes": 128 << 20},
              "decode": {**HALF_CPU, "kv_cache_memory_bytes": 128 << 20},
              "transfer": {"backends": ["ucx"], "pin_lease_s": LEASE_S}, "server": {"admin_api": True}}
    with running_server(tmp_path_factory.mktemp("integrity_pins"), config) as srv:
        yield srv


def _drop_after(url: str, prompts: list[list[int]], chunks: int, max_tokens: int) -> list[int]:
    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            return await asyncio.gather(*[stream_until(client, url, {"model": "tiny", "prompt": p, "max_tokens":
                                                                      max_tokens, "ignore_eos": True}, chunks)
                                          for p in prompts])
    return asyncio.run(run())


def _drop_during_prefill(url: str, prompts: list[list[int]]) -> None:
    """Clients that leave while their prompts are being computed (booked on the prefill worker)."""
    async def run() -> None:
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            tasks = [asyncio.create_task(stream_until(client, url, {"model": "tiny", "prompt": p, "max_tokens": 32,
                                                                     "ignore_eos": True}, 10**9)) for p in prompts]
            deadline = time.monotonic() + DEADLINE_S
            while sum(metric_values(url, "pdserve_worker_booked_prompt_tokens").values()) < 4 * len(prompts[0]):
                assert time.monotonic() < deadline, "the prompts were never booked"
                await asyncio.sleep(0.01)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.run(run())


def _expired(report: dict) -> dict[str, int]:
    return {name: check["expired_pins"] for name, check in report["workers"].items()}


def test_requests_aborted_in_every_phase_leave_no_pin_for_the_lease(server):
    url = server.url
    _drop_during_prefill(url, random_prompts([1500] * 16, VOCAB, seed=61))
    short = random_prompts([100 + 7 * i for i in range(16)], VOCAB, seed=62)
    assert _drop_after(url, short, 1, 64) == [1] * 16  # right after the first token: the handoff under way
    assert _drop_after(url, short, 5, 300) == [5] * 16  # mid-decode
    # idle means every block is free again: a pin nothing released would have waited for its lease, which counts it
    wait_for_idle_workers(url, DEADLINE_S)
    report = admin_integrity(url)
    assert report["ok"] and report["mismatches"] == [], report
    assert _expired(report) == {"prefill-0": 0, "decode-0": 0}, report
    assert_nothing_booked(url)


def _hold_until_not_ok(url: str, prompts: list[list[int]]) -> dict:
    """Streams that read their first token and then stay connected (unread) until /admin/integrity is not ok;
    returns that report. Staying matters: a client that left before its handoff began has its prefill pin freed
    at once (nothing will read it), which leaves nothing for the lease to free."""
    async def run() -> dict:
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            async with contextlib.AsyncExitStack() as streams:
                for p in prompts:
                    body = {"model": "tiny", "prompt": p, "max_tokens": 64, "ignore_eos": True, "stream": True}
                    r = await streams.enter_async_context(client.stream("POST", f"{url}/v1/completions", json=body))
                    assert r.status_code == 200, await r.aread()
                    lines = r.aiter_lines()
                    while not (await anext(lines)).startswith("data: "):
                        pass
                deadline = time.monotonic() + DEADLINE_S
                while True:
                    r = await client.get(f"{url}/admin/integrity", headers=OPERATOR, timeout=30)
                    assert r.status_code == 200, r.text
                    if not (report := r.json())["ok"]:
                        return report
                    assert time.monotonic() < deadline, f"integrity never saw the pins the lease freed: {report}"
                    await asyncio.sleep(0.5)
    return asyncio.run(run())


def test_pins_left_past_their_lease_are_reported_not_ok(server):
    url = server.url
    # every KV transfer (push or pull) held back well past the lease, so the prefill's pins outlive it
    r = httpx.post(f"{url}/admin/faults", headers=OPERATOR, timeout=30,
                   json={"transfer_stall_fraction": 1.0, "transfer_stall_s": 3 * LEASE_S})
    assert r.status_code == 200, r.text
    try:
        report = _hold_until_not_ok(url, random_prompts([120 + 11 * i for i in range(8)], VOCAB, seed=63))
    finally:
        assert httpx.post(f"{url}/admin/faults", headers=OPERATOR, json={}, timeout=30).status_code == 200
    assert any(m.startswith("prefill-0: ") and "outlived transfer.pin_lease_s" in m
               for m in report["mismatches"]), report
    assert report["error"] == report["mismatches"][0] and _expired(report)["prefill-0"] >= 1, report
    deadline = time.monotonic() + DEADLINE_S  # the engines' loads in /metrics lag up to a probe behind
    while metric_values(url, "pdserve_worker_engine_expired_pins_total")['{worker="prefill-0",role="prefill"}'] < 1:
        assert time.monotonic() < deadline, "the prefill worker's expired pins never showed in /metrics"
        time.sleep(0.25)
    # once the stalled transfers have ended and their expiries were reported (each once, in the report after it),
    # nothing is left and integrity is ok again. The pins expire one by one, and integrity is ok between two
    # expiries' reports (CI once saw it ok after the first and not ok again after the other seven): so first wait
    # until no pin has expired for a lease's length, then for ok
    deadline = time.monotonic() + DEADLINE_S
    counted, quiet_since = None, time.monotonic()
    while time.monotonic() - quiet_since < LEASE_S + 1.0:
        assert time.monotonic() < deadline, "the prefill worker's pins kept expiring"
        now = metric_values(url, "pdserve_worker_engine_expired_pins_total")['{worker="prefill-0",role="prefill"}']
        if now != counted:
            counted, quiet_since = now, time.monotonic()
        time.sleep(0.25)
    deadline = time.monotonic() + DEADLINE_S
    while not (report := admin_integrity(url))["ok"]:
        assert time.monotonic() < deadline, f"integrity stays not ok: {report}"
        assert all("prefill-0: " in m or "decode-0: " in m for m in report["mismatches"]), report
        time.sleep(0.5)
    assert_nothing_booked(url)
