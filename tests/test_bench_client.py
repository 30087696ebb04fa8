"""The benchmark client against a tiny local HTTP server that streams scripted SSE events at known delays.

Timing checks are causal lower bounds only (a measured time can never be earlier than the server's sleep),
never upper bounds on a loaded machine.
"""

import argparse
import asyncio
import json
import threading

import httpx
import pytest

from benchclient.arrivals import ArrivalSpec, send_times
from benchclient.cli import _run_config, add_bench_parser
from benchclient.client import Target, stream_request
from benchclient.run import RunConfig, run_load, run_report
from benchclient.stats import SLO
from benchclient.workload import BenchRequest, WorkloadSpec
from coordinator import cli

pytestmark = pytest.mark.timeout(60)


def _chunk(text, finish=None):
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}}
PHASES = {"ingress": 0.001, "admission": 0.0, "prefill_compute": 0.049, "decode": 0.1, "overhead": 0.05}
# Each script: (delay before the write in s, bytes). "ok": 7 tokens in 5 chunks (the last only finishes).
SCRIPTS = {
    "ok": [(0.2, _chunk("a")), (0.05, _chunk("bc")), (0.05, _chunk("de")), (0.05, _chunk("fg")),
           (0.0, _chunk("", "length")), (0.0, USAGE), (0.0, "[DONE]")],
    "split": [(0.0, b'data: {"choices": [{"index": 0, "te'), (0.3, b'xt": "a", "finish_reason": "length"}]}\n\n'),
              (0.0, {**USAGE, "usage": {"prompt_tokens": 4, "completion_tokens": 1}}), (0.0, "[DONE]")],
    "inband": [(0.0, _chunk("a")), (0.0, {"error": {"message": "worker died", "type": "internal"}}),
               (0.0, "[DONE]")],
    "cut": [(0.0, _chunk("a")), (0.0, _chunk("b"))],
    "nousage": [(0.0, _chunk("a")), (0.01, _chunk("b")), (0.01, _chunk("c", "stop")), (0.0, "[DONE]")],
    "fast": [(0.0, _chunk("a")), (0.0, _chunk("b", "length")), (0.0, USAGE), (0.0, "[DONE]")],
    "slow": [(5.0, _chunk("a")), (0.0, "[DONE]")],
    "phased": [(0.0, _chunk("a")), (0.0, _chunk("b", "length")), (0.0, {**USAGE, "phases": PHASES}),
               (0.0, "[DONE]")],
}


class ScriptedServer:
    """HTTP/1.1 on a free loopback port; request i gets `plan[i % len(plan)]` ("500" answers HTTP 500);
    GET /v1/models lists model "m", owned by `owner`."""

    def __init__(self, plan, owner="someone"):
        self.plan, self.bodies, self.owner = plan, [], owner
        self.open = self.most_open = 0  # connections being answered now, and at most

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _handle(self, reader, writer):
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            if head.startswith("GET /v1/models"):
                body = json.dumps({"data": [{"id": "m", "owned_by": self.owner}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                             b"Connection: close\r\n\r\n%s" % (len(body), body))
                return
            length = int(next(ln.split(":")[1] for ln in head.split("\r\n") if ln.lower().startswith("content-length")))
            self.bodies.append(json.loads(await reader.readexactly(length)))
            name = self.plan[(len(self.bodies) - 1) % len(self.plan)]
            if name == "500":
                body = b'{"error": {"message": "boom"}}'
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
                for delay, item in SCRIPTS[name]:
                    await asyncio.sleep(delay)
                    writer.write(item if isinstance(item, bytes) else
                                 b"data: " + (item if isinstance(item, str) else json.dumps(item)).encode() + b"\n\n")
                    await writer.drain()
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open -= 1
            writer.close()


HELLO = BenchRequest("hello world", 2, 7)


def _stream(plan, req=HELLO, **target):
    async def go():
        async with ScriptedServer(plan) as server, httpx.AsyncClient(timeout=30) as client:
            result = await stream_request(client, Target(url=server.url, model="m", **target), req)
            return result, (server.bodies or [None])[0]
    return asyncio.run(go())


def test_a_known_stream_is_measured_from_its_bytes_and_usage():
    r, body = _stream(["ok"], ignore_eos=True)
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    assert body["prompt"] == "hello world" and body["max_tokens"] == 7 and body["stream"] is True
    assert r.ok and r.finish_reason == "length" and r.prompt_tokens == 4
    assert r.completion_tokens == 7 and r.tokens_from_usage  # from usage, not the 5 chunks
    assert len(r.chunk_times) == 5 and len(r.itl) == 4        # every chunk with a choice, as vLLM counts them
    assert r.chunk_times == sorted(r.chunk_times)
    assert r.ttft >= 0.2
    assert r.tpot == pytest.approx((r.e2e - r.ttft) / 6)
    assert r.end >= r.chunk_times[-1]


def test_an_event_counts_when_its_last_byte_arrives():
    r, _ = _stream(["split"])
    assert r.ok and r.completion_tokens == 1 and r.ttft >= 0.3


@pytest.mark.parametrize("plan, error", [("500", "HTTP 500"), ("inband", "in-band error: worker died"),
                                         ("cut", "stream ended without [DONE]")])
def test_failures_are_results_with_errors(plan, error):
    r, _ = _stream([plan])
    assert not r.ok and r.error.startswith(error)


def test_without_usage_tokens_are_counted_from_chunks_and_flagged():
    r, _ = _stream(["nousage"])
    assert r.ok and not r.tokens_from_usage and r.completion_tokens == 3


def test_chat_endpoint_sends_messages_and_id_prompts_need_completions():
    r, body = _stream(["fast"], endpoint="chat")
    assert body["messages"] == [{"role": "user", "content": "hello world"}] and r.ok
    r, _ = _stream(["fast"], req=BenchRequest([5, 6, 7], 3, 2), endpoint="chat")
    assert not r.ok and "completions endpoint" in r.error


def _run(plan, server_out=None, **cfg):
    async def go():
        async with ScriptedServer(plan) as server:
            config = RunConfig(target=Target(url=server.url, model="m"), slo=SLO(ttft_ms=10_000, tpot_ms=10_000),
                               **cfg)
            if server_out is not None:
                server_out.append(server)
            return await run_load(config), config
    results, config = asyncio.run(go())
    return results, run_report(config, results)


def test_a_run_counts_every_failure_and_goodput_only_successes():
    results, doc = _run(["fast", "500", "inband", "cut"], arrival=ArrivalSpec(kind="concurrency", concurrency=1),
                        warmup_s=0, num_requests=8)
    s = doc["summary"]
    assert len(results) == 8 and (s["requests"], s["completed"], s["failed"]) == (8, 2, 6)
    assert s["errors"] == {"HTTP 500": 2, "in-band error": 2, "stream ended without [DONE]": 2}
    assert s["goodput"] * s["duration_s"] == pytest.approx(2)
    assert s["output_token_throughput"] * s["duration_s"] == pytest.approx(14)
    assert len(doc["requests"]) == 8 and doc["settings"]["target"]["model"] == "m"


def test_open_loop_marks_warmup_by_schedule_and_waits_for_stragglers():
    arrival = ArrivalSpec(kind="poisson", rate=40.0, seed=5)
    results, doc = _run(["fast"], arrival=arrival, warmup_s=0.1, duration_s=0.3,
                        workload=WorkloadSpec(input_len=3, output_len=2))
    assert len(results) == len(send_times(arrival, 0.4))
    assert doc["summary"]["warmup_requests"] == len(send_times(arrival, 0.1))
    assert all(r.ok and r.end is not None for r in results)


def test_a_request_past_its_timeout_is_a_failure():
    results, doc = _run(["slow", "fast"], arrival=ArrivalSpec(kind="concurrency", concurrency=2),
                        warmup_s=0, num_requests=2, timeout_s=0.5)
    assert doc["summary"]["errors"] == {"timeout after 0.5 s": 1} and doc["summary"]["completed"] == 1


def test_closed_loop_never_exceeds_its_concurrency():
    servers = []
    results, doc = _run(["ok"], servers, arrival=ArrivalSpec(kind="concurrency", concurrency=3), warmup_s=0,
                        num_requests=7)
    assert len(results) == 7 and doc["summary"]["completed"] == 7
    assert 1 <= servers[0].most_open <= 3


@pytest.fixture
def scripted_url(request):
    """A ScriptedServer ("fast" streams; or `param`: (plan, owner)) on its own event loop thread, for code that runs
    its own loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = ScriptedServer(*getattr(request, "param", (["fast"],)))
    asyncio.run_coroutine_threadsafe(server.__aenter__(), loop).result(10)
    yield server.url
    asyncio.run_coroutine_threadsafe(server.__aexit__(None, None, None), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_pdserve_bench_command_saves_figures_and_requests(scripted_url, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli.main(["bench", "--url", scripted_url, "--model", "m", "--concurrency", "2", "--num-requests", "5",
                   "--warmup", "0", "--workload", "uniform", "--input-len", "9", "--output-len", "3",
                   "--prompt-format", "ids", "--ignore-eos", "--out", str(out)])
    assert rc == 0 and "TTFT" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["summary"]["completed"] == 5 and len(doc["requests"]) == 5
    assert doc["settings"]["arrival"]["concurrency"] == 2 and doc["settings"]["workload"]["kind"] == "uniform"
    assert cli.main(["bench", "--url", scripted_url, "--model", "m", "--rate", "1", "--concurrency", "2"]) == 2
    assert "one of --rate" in capsys.readouterr().err


def test_phases_are_asked_for_only_when_wanted_and_kept_per_request():
    r, body = _stream(["phased"], phases=True)
    assert body["stream_options"] == {"include_usage": True, "include_phases": True}
    assert r.ok and r.completion_tokens == 7 and r.phases == PHASES
    r, body = _stream(["ok"])
    assert body["stream_options"] == {"include_usage": True} and r.phases is None


@pytest.mark.parametrize("scripted_url", [(["phased"], "pdserve")], indirect=True)
def test_pdserve_bench_asks_pdserve_for_phases_and_prints_where_the_time_went(scripted_url, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli.main(["bench", "--url", scripted_url, "--concurrency", "1", "--num-requests", "3", "--warmup", "0",
                   "--out", str(out)])  # --phases auto: /v1/models says the server is pdserve
    printed = capsys.readouterr().out
    assert rc == 0 and "where did the time go (3 requests" in printed
    rows = {line.split()[0]: line.split()[1:] for line in printed.splitlines()[-7:]}
    assert rows["prefill_compute"] == ["49.0", "24.5%", "24.5%", "24.5%"] and rows["total"][1] == "200.0"
    doc = json.loads(out.read_text())
    assert [r["phases_s"] for r in doc["requests"]] == [PHASES] * 3
    assert doc["phases"]["requests"] == 3 and list(doc["phases"]["phases"]) == list(PHASES)


@pytest.mark.parametrize("scripted_url, owner", [((["ok"], "pdserve"), "pdserve"), ((["ok"], "vllm"), "vllm")],
                         indirect=["scripted_url"])
def test_bench_phases_auto_asks_only_pdserve_and_on_or_off_decide(scripted_url, owner):
    def asks(*flags: str) -> bool:
        parser = argparse.ArgumentParser()
        add_bench_parser(parser.add_subparsers())
        args = parser.parse_args(["bench", "--url", scripted_url, "--concurrency", "1", *flags])
        return _run_config(args).target.phases
    assert asks() is (owner == "pdserve") and asks("--model", "m") is (owner == "pdserve")
    assert asks("--phases", "on") is True and asks("--phases", "off") is False
