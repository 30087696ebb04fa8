"""What a coordinator restart keeps and what it never reads again, on the real server (`pdserve serve`, tiny, 1 prefill
+ 1 decode, tenants), issue 46: a tenant's token charges outlive a SIGKILLed coordinator (the next one refuses what
the window no longer holds, instead of starting every tenant afresh), and a YAML file edited in place to an invalid
value after the start cannot stop the server: the coordinator started again after a SIGKILL runs with the
configuration the server started with and adopts the same workers."""

import os
import signal

import httpx
import pytest
import yaml

from tests.server_process import HALF_CPU, live_worker_pids, poll, running_server
from tests.test_coordinator_restart import _alive, _coordinator_pid, _serving

pytestmark = pytest.mark.timeout(600)
DEADLINE_S = 180.0  # generous bound for polled states on a loaded 2-core machine (never a measured duration)
METERED = {"Authorization": "Bearer k-metered"}
FREE = {"Authorization": "Bearer k-free"}
BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = {"model": "tiny", "prefill": HALF_CPU, "decode": HALF_CPU, "transfer": {"backends": ["ucx"]},
              "recovery": {"backoff_initial_s": 0.2},
              "tenants": [{"name": "free", "api_keys": ["k-free"]},
                          {"name": "metered", "api_keys": ["k-metered"], "tokens_per_minute": 300}]}
    workdir = tmp_path_factory.mktemp("restart-state")
    with running_server(workdir, config) as srv:
        yield srv, workdir


def _restart_coordinator(server) -> None:
    """SIGKILL the serving coordinator; return once it is gone and another one serves."""
    first = _coordinator_pid(server.pid)
    assert first is not None and _serving(server.url), "no serving coordinator under the supervisor before the kill"
    os.kill(first, signal.SIGKILL)
    assert poll(lambda: not _alive(first), DEADLINE_S), f"the SIGKILLed coordinator {first} still runs"
    assert poll(lambda: _coordinator_pid(server.pid) not in (None, first), DEADLINE_S)
    assert poll(lambda: _serving(server.url), DEADLINE_S)


def _complete(server, headers: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json=BODY, headers=headers, timeout=DEADLINE_S)


def test_a_tenants_token_charges_outlive_a_coordinator_restart(server):
    server, _ = server
    used = _complete(server, METERED)
    assert used.status_code == 200, used.text
    assert used.json()["usage"]["total_tokens"] > 150  # over half the tenant's minute
    _restart_coordinator(server)
    refused = _complete(server, METERED)  # a coordinator that forgot would have the whole minute free
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and int(refused.headers["retry-after"]) >= 1
    assert _complete(server, FREE).status_code == 200  # the other tenant is served as before


def test_an_invalid_edit_of_the_yaml_cannot_stop_the_server_at_a_restart(server):
    server, workdir = server
    workers = {role: live_worker_pids(server, role) for role in ("prefill", "decode")}
    path = workdir / "serve.yaml"
    edited = yaml.safe_load(path.read_text())
    edited["mode"] = "no-such-mode"   # an operator's careless edit, in place, while the server runs
    edited["decode"]["max_num_seqs"] = -1
    path.write_text(yaml.safe_dump(edited))
    _restart_coordinator(server)
    _restart_coordinator(server)  # again: no restart reads the file
    r = _complete(server, FREE)
    assert r.status_code == 200, r.text
    assert {role: live_worker_pids(server, role) for role in ("prefill", "decode")} == workers  # adopted
    log = (workdir / "server.log").read_text(errors="replace")
    assert "no-such-mode" not in log
