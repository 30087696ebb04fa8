"""Draining one worker on the real server (`pdserve serve`, local Ray, the embedded `tiny` model, UCX between
workers; coordinator.backend.drains): `POST /admin/workers/{name}/drain` routes no new work to the worker while its
running streams finish with exactly the engine's output, /health then says it is drained, the last worker that can
prefill or decode cannot be drained (409), and undrained it serves again, with no request failed and nothing left
booked (1 prefill + 2 decode workers). In mode adaptive a drained worker is out of the planner's reach: when the only
decoding worker dies, the drained one is not made to decode, nor can an operator change its role; a drained worker
that crashes comes back drained, one restarted through the admin API's kill comes back routed to."""

import asyncio
import os
import signal
from functools import partial

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts
from tests.server_process import (
    HALF_CPU,
    OPERATOR,
    admin_kill,
    assert_nothing_booked,
    busiest_worker,
    complete,
    metric_values,
    poll,
    running_server,
    wait_for_health,
    worker_pids,
)

pytestmark = pytest.mark.timeout(600)
VOCAB = 2000
DEADLINE_S = 180.0  # generous bound for polled states on a loaded 2-core machine (never a measured duration)
_poll = partial(poll, deadline_s=DEADLINE_S)


def _admin(url: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", headers=OPERATOR, json=body, timeout=30)


def _body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}


def _expected(reference: LLM, bodies: list[dict]) -> list[str]:
    return [reference.generate([b["prompt"]], SamplingParams(temperature=0, max_tokens=b["max_tokens"],
                                                             ignore_eos=True))[0].text for b in bodies]


def _routed(url: str) -> dict[str, float]:
    """Requests the router sent to each decode worker so far (pdserve_worker_requests_routed)."""
    values = metric_values(url, "pdserve_worker_requests_routed")
    return {name: values.get(f'{{worker="{name}",role="decode"}}', 0.0) for name in ("decode-0", "decode-1")}


def _worker(url: str, name: str) -> dict:
    return next(w for w in httpx.get(f"{url}/health", timeout=10).json()["workers"] if w["name"] == name)


def test_a_drained_worker_finishes_its_streams_takes_no_new_work_and_serves_again_once_undrained(tmp_path):
    config = {"model": "tiny", "prefill": HALF_CPU, "decode": {**HALF_CPU, "workers": 2},
              "transfer": {"backends": ["ucx"]}, "admission": {"timeout_s": 120}, "server": {"admin_api": True}}
    reference = LLM("tiny")
    running = [_body(p, 160) for p in random_prompts([8 + 3 * i for i in range(8)], VOCAB, seed=36)]
    later = [_body(p, 24) for p in random_prompts([5 + 7 * i for i in range(8)], VOCAB, seed=37)]
    wanted_running, wanted_later = _expected(reference, running), _expected(reference, later)
    with running_server(tmp_path, config) as server:
        url = server.url

        async def run() -> tuple:
            decoding, started = asyncio.Event(), []

            def progress(chunks: int) -> None:
                if chunks == 2:  # the first token from the decode worker: every stream is placed and decoding
                    started.append(1)
                    if len(started) == len(running):
                        decoding.set()
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                streams = [asyncio.create_task(complete(client, url, b, progress)) for b in running]
                await asyncio.wait_for(decoding.wait(), DEADLINE_S)
                target = await asyncio.to_thread(busiest_worker, url, "decode", ["decode-0", "decode-1"])
                assert target in ("decode-0", "decode-1"), target  # one of them runs streams
                drained = await asyncio.to_thread(_admin, url, f"/admin/workers/{target}/drain")
                other = "decode-1" if target == "decode-0" else "decode-0"
                refusals = await asyncio.gather(*[asyncio.to_thread(_admin, url, f"/admin/workers/{name}/drain")
                                                  for name in (other, "prefill-0", "nobody")])
                routed = await asyncio.to_thread(_routed, url)
                served = await asyncio.gather(*[complete(client, url, b) for b in later])  # while it drains
                routed_after = await asyncio.to_thread(_routed, url)
                return target, other, drained, refusals, routed, routed_after, served, await asyncio.gather(*streams)
        target, other, drained, refusals, routed, routed_after, served, finished = asyncio.run(run())

        assert drained.status_code == 200 and drained.json() == {"worker": target, "drain": "draining"}
        last_decode, last_prefill, unknown = refusals
        assert last_decode.status_code == 409, last_decode.text
        error = last_decode.json()["error"]
        assert error["param"] == "name" and f"{other} is the last live worker that can decode" in error["message"]
        assert last_prefill.status_code == 409 and "last live worker that can prefill" in last_prefill.text
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "name"
        # its running streams finished exactly; every new request went to the other worker, and finished exactly
        assert [r["text"] for r in finished] == wanted_running
        assert [r["text"] for r in served] == wanted_later
        assert routed_after[target] == routed[target], (routed, routed_after)
        assert routed_after[other] == routed[other] + len(later), (routed, routed_after)

        assert _poll(lambda: _worker(url, target).get("drain") == "drained"), _worker(url, target)
        assert metric_values(url, "pdserve_worker_drained")[f'{{worker="{target}",role="decode"}}'] == 1
        assert _worker(url, target)["state"] == "live"
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # the other worker serves

        undrained = _admin(url, f"/admin/workers/{target}/undrain")
        assert undrained.status_code == 200 and undrained.json() == {"worker": target, "undrained": True}
        assert "drain" not in _worker(url, target)

        async def again() -> list[dict]:
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                return await asyncio.gather(*[complete(client, url, b) for b in later[:4]])
        assert [r["text"] for r in asyncio.run(again())] == wanted_later[:4]
        assert _routed(url)[target] > routed_after[target]  # it serves again
        outcomes = metric_values(url, "pdserve_requests_total")
        assert outcomes.get('{outcome="failed"}', 0) == 0 and outcomes.get('{outcome="aborted"}', 0) == 0, outcomes
        assert outcomes['{outcome="finished"}'] == len(running) + len(later) + 4
        assert_nothing_booked(url)


def test_mode_adaptive_the_planner_does_not_make_a_drained_worker_decode(tmp_path):
    pool = {**HALF_CPU, "max_num_seqs": 64, "max_num_batched_tokens": 1024}
    config = {"model": "tiny", "mode": "adaptive", "slo": {"ttft_ms": 300, "tpot_ms": 40},
              "planner": {"enabled": False, "interval_s": 0.5},  # only its rule for a pool with no decoding worker
              "prefill": pool, "decode": pool, "transfer": {"backends": ["ucx"]},
              "recovery": {"backoff_initial_s": 0.1}, "admission": {"timeout_s": 120},
              "server": {"admin_api": True, "api_processes": 2}}  # the admin calls also cross to the core process
    reference = LLM("tiny")
    bodies = [_body(p, 16) for p in random_prompts([12, 30, 47], VOCAB, seed=38)]
    wanted = _expected(reference, bodies)
    with running_server(tmp_path, config) as server:
        url = server.url
        refused = _admin(url, "/admin/workers/decode-0/drain")
        assert refused.status_code == 409 and "last live worker that can decode" in refused.text
        assert _admin(url, "/admin/workers/prefill-0/drain").json()["drain"] == "draining"
        assert _poll(lambda: _worker(url, "prefill-0").get("drain") == "drained")
        role = _admin(url, "/admin/workers/prefill-0/role", {"role": "mixed"})
        assert role.status_code == 400 and "drained" in role.json()["error"]["message"]

        remote = metric_values(url, "pdserve_prefill_placement_total").get('{placement="remote"}', 0)
        asyncio.run(admin_kill(url, "decode-0"))  # the only decoding worker: the planner's rule would make another
        wait_for_health(url, 200, DEADLINE_S)     # decode at once, but the drained one is not its to change

        async def run() -> list[dict]:
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                return await asyncio.gather(*[complete(client, url, b) for b in bodies])
        assert [r["text"] for r in asyncio.run(run())] == wanted
        assert _poll(lambda: _worker(url, "decode-0")["state"] == "live")  # (/health lags the core a little)
        assert _worker(url, "prefill-0")["role"] == "prefill"
        changes = metric_values(url, "pdserve_role_changes_total")
        assert not any(v for v in changes.values()), changes
        assert metric_values(url, "pdserve_prefill_placement_total").get('{placement="remote"}', 0) == remote

        # a crash does not end a drain: the replacement comes back drained; a restart on purpose (the admin API's
        # kill, a rolling restart's step) does: the replacement is routed to
        pids = worker_pids(server, "prefill")
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        back = _poll(lambda: (w := _worker(url, "prefill-0"))["state"] == "live" and w["restarts"] == 1 and w)
        assert back and back.get("drain") == "drained", back
        asyncio.run(admin_kill(url, "prefill-0"))
        back = _poll(lambda: (w := _worker(url, "prefill-0"))["state"] == "live" and w["restarts"] == 2 and w)
        assert back and "drain" not in back, back
        assert [r["text"] for r in asyncio.run(run())] == wanted
        assert_nothing_booked(url)
        for _ in range(8):  # whichever HTTP process takes it asks the core (it was a 501 in all but the first)
            listed = httpx.get(f"{url}/admin/requests", headers=OPERATOR, timeout=30)
            assert listed.status_code == 200 and listed.json() == {"object": "list", "data": []}, listed.text
            assert httpx.get(f"{url}/admin/requests/gone-1", headers=OPERATOR, timeout=30).status_code == 404
