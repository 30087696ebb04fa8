"""/admin/integrity over many restarts on the real server (`pdserve serve`, local Ray, mode collocated, one `tiny`
worker): each incarnation of the slot serves a request (so the coordinator's books hold an entry for it), then is
killed and replaced; the report keeps the live incarnation and a bounded history of dead ones
(coordinator.admission.reservation: RECENT_RETIRED), not one entry per restart, and stays clean."""

import asyncio

import httpx
import pytest

from coordinator.admission.reservation import RECENT_RETIRED
from tests.server_process import HALF_CPU, OPERATOR, admin_integrity, admin_kill, poll, running_server

pytestmark = pytest.mark.timeout(600)
DEADLINE_S = 180.0  # generous bound for polled states on a loaded machine (never a measured duration)
KILLS = RECENT_RETIRED + 1  # one more than the history keeps: before the bound, every one stayed


def _worker(url: str) -> dict:
    return httpx.get(f"{url}/health", headers=OPERATOR, timeout=10).json()["workers"][0]


def test_the_integrity_report_keeps_a_bounded_history_of_dead_incarnations(tmp_path):
    config = {"model": "tiny", "mode": "collocated", "decode": HALF_CPU, "server": {"admin_api": True},
              "recovery": {"max_restarts": KILLS + 5, "backoff_initial_s": 0.1, "backoff_max_s": 0.2}}
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    with running_server(tmp_path, config) as server:
        url = server.url
        for restarts in range(1, KILLS + 1):
            served = httpx.post(f"{url}/v1/completions", json=body, timeout=DEADLINE_S)
            assert served.status_code == 200, served.text
            asyncio.run(admin_kill(url, "decode-0"))
            assert poll(lambda r=restarts: _worker(url)["state"] == "live" and _worker(url)["restarts"] == r,
                        DEADLINE_S), _worker(url)
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=DEADLINE_S).status_code == 200
        integrity = admin_integrity(url)
        assert integrity["ok"], integrity
        kept = integrity["coordinator"]
        assert f"decode-0#{KILLS}" in kept and len(kept) <= 1 + RECENT_RETIRED, kept  # live + recent dead ones
        assert all(v == 0 for kinds in kept.values() for v in kinds.values()), kept
