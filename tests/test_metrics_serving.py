"""/metrics on the real server (`tiny`, 1 prefill + 1 decode, stream_interval 4) after a few requests of every shape:
every exported family's name and type equals the list below (pdserve's and vLLM's: a rename, a new family or a
changed type fails here and is updated with the docs), and the figures add up to what the clients were answered:
finished sequences by reason (tool_calls included), prompt and generated tokens equal to the usage the responses
reported, one inter-token sample per token after each sequence's first (4 tokens a delivery here), vLLM's queue and
prefill times equal to the phases they are made of. And vLLM's scheduler families as vLLM's own server tests read
them (tests/entrypoints/openai/test_metrics.py): tokens per engine step counted as vLLM counts them, requests
running in each engine's batch, waiting by reason."""

from __future__ import annotations

import asyncio
import json
import math
import re

import httpx
import pytest

from tests.server_process import HALF_CPU, poll, running_server, scrape, values_in, wait_for_idle_workers

pytestmark = pytest.mark.timeout(400)
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Call f."}], "max_tokens": 200, "seed": 3,
        "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
LENGTH = {"model": "tiny", "prompt": "The sea at night", "max_tokens": 9, "ignore_eos": True, "temperature": 0}

_HISTOGRAMS = ("pdserve_e2e_request_latency_seconds", "pdserve_inter_token_latency_seconds",
               "pdserve_request_generation_tokens", "pdserve_request_phase_seconds", "pdserve_request_prompt_tokens",
               "pdserve_time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
               "vllm:inter_token_latency_seconds", "vllm:iteration_tokens_total", "vllm:request_decode_time_seconds",
               "vllm:request_generation_tokens", "vllm:request_inference_time_seconds",
               "vllm:request_max_num_generation_tokens", "vllm:request_params_max_tokens", "vllm:request_params_n",
               "vllm:request_prefill_time_seconds", "vllm:request_prompt_tokens", "vllm:request_queue_time_seconds",
               "vllm:request_time_per_output_token_seconds", "vllm:time_to_first_token_seconds")
_COUNTERS = (
    "pdserve_admission_bypassed", "pdserve_backend_errors", "pdserve_coordinator_gc_full_collections",
    "pdserve_coordinator_gc_pause_seconds", "pdserve_coordinator_gc_pauses", "pdserve_coordinator_loop_stalls",
    "pdserve_errors", "pdserve_fallback_placements", "pdserve_generation_tokens", "pdserve_migrations",
    "pdserve_pool_down_seconds",
    "pdserve_prefill_placement", "pdserve_prefix_affinity_hits", "pdserve_prompt_tokens", "pdserve_request_finish",
    "pdserve_requests", "pdserve_role_changes", "pdserve_worker_engine_gc_full_collections",
    "pdserve_worker_engine_gc_pause_seconds", "pdserve_worker_engine_gc_pauses", "pdserve_worker_engine_preemptions",
    "pdserve_worker_engine_prefix_hit_tokens", "pdserve_worker_engine_prefix_query_tokens",
    "pdserve_worker_engine_sampled_tokens", "pdserve_worker_engine_scheduled_tokens",
    "pdserve_tenant_completion_tokens", "pdserve_tenant_prompt_tokens", "pdserve_tenant_rate_limited",
    "pdserve_tenant_requests", "pdserve_worker_restarts", "vllm:generation_tokens",
    "vllm:num_preemptions", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:prompt_tokens",
    "vllm:request_success", "pdserve_admission_booking_grown_blocks", "pdserve_stalled_clients",
    "pdserve_worker_engine_expired_pins", "pdserve_worker_engine_head_bypassed", "pdserve_worker_engine_lane_jobs",
    "pdserve_worker_engine_preemptions_decode", "pdserve_worker_engine_preemptions_prompt",
    "pdserve_worker_preemptions", "pdserve_stragglers", "pdserve_spare_takeovers", "pdserve_worker_engine_swapped_out",
    "pdserve_worker_engine_swapped_in", "pdserve_worker_engine_swap_out_bytes", "pdserve_worker_engine_swap_in_bytes",
    "pdserve_worker_engine_swap_full", "pdserve_worker_engine_handoff_hit_blocks",
    "pdserve_worker_engine_iteration_tokens", "pdserve_pool_scale_events", "pdserve_prefix_fetches",
    "pdserve_worker_engine_lent_blocks", "pdserve_worker_engine_lent_host_blocks",
    "pdserve_worker_engine_fetched_blocks",
    *(f"{prefix}{key}" for prefix in ("pdserve_kv_tier_", "pdserve_worker_engine_host_tier_")
      for key in ("hit_blocks", "hit_tokens", "miss_blocks", "in_bytes", "out_bytes", "evictions", "dropped",
                  "recompute_blocks")))
_GAUGES = (
    "pdserve_backend_requests_in_flight", "pdserve_backend_stats_errors", "pdserve_coordinator_gc_pause_max_s",
    "pdserve_coordinator_loop_lag_max_seconds", "pdserve_coordinator_loop_lag_seconds", "pdserve_draining",
    "pdserve_queue_length", "pdserve_requests_in_flight", "pdserve_spares_ready", "pdserve_tenant_in_flight",
    "pdserve_worker_alive",
    "pdserve_worker_booked_kv_blocks",
    "pdserve_worker_booked_prompt_tokens", "pdserve_worker_engine_cached_blocks",
    "pdserve_worker_engine_decode_step_s", "pdserve_worker_engine_gc_pause_max_s", "pdserve_worker_engine_num_pinned",
    "pdserve_worker_engine_num_reserved", "pdserve_worker_engine_num_waiting",
    "pdserve_worker_engine_prefill_budget_tokens", "pdserve_worker_engine_prefill_token_s",
    "pdserve_worker_engine_lane_token_s",
    "pdserve_worker_engine_step_time_last_s", "pdserve_worker_engine_step_time_total_s",
    "pdserve_worker_engine_steps", "pdserve_worker_drained", "pdserve_worker_draining",
    "pdserve_worker_used_kv_blocks", "pdserve_worker_engine_swap_used_blocks", "pdserve_prefix_index_host_blocks",
    *(f"{prefix}{key}" for prefix in ("pdserve_kv_tier_", "pdserve_worker_engine_host_tier_")
      for key in ("used_blocks", "total_blocks", "used_bytes", "capacity_bytes")),
    "pdserve_worker_free_blocks", "pdserve_worker_kv_usage_ratio", "pdserve_worker_queued_prompt_tokens",
    "pdserve_worker_requests_routed", "pdserve_worker_running", "pdserve_worker_state", "pdserve_worker_total_blocks",
    "pdserve_worker_step_time_ratio", "pdserve_worker_straggler", "pdserve_worker_start_seconds",
    "pdserve_worker_engine_grammar_load_s",
    "pdserve_worker_engine_graphs_pending", "pdserve_worker_engine_graph_capture_s",
    "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:num_requests_waiting_by_reason")
# every family /metrics exports (as its `# TYPE` lines name them: counters with `_total`), none other; besides these,
# `pdserve_transfer_<key>` for each number the KV-transfer agents count (which depends on the transfer path taken):
# a counter when the key ends in `_total`, else a gauge
FAMILIES = {**{n: "histogram" for n in _HISTOGRAMS}, **{n + "_total": "counter" for n in _COUNTERS},
            **{n: "gauge" for n in _GAUGES}}
TRANSFER = "pdserve_transfer_"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = {"model": "tiny", "prefill": HALF_CPU, "decode": HALF_CPU, "server": {"stream_interval": 4}}
    with running_server(tmp_path_factory.mktemp("server_metrics"), config) as server:
        yield server


def _post(client: httpx.Client, path: str, body: dict) -> list[dict]:
    """The response's JSON, or a stream's chunks (each `data:` line parsed; the stream must end with [DONE])."""
    if not body.get("stream"):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        return [r.json()]
    with client.stream("POST", path, json={**body, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def _finishes(chunks: list[dict]) -> list[str]:
    return [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]


def _one(text: str, name: str, labels: str | None = None) -> float:
    values = values_in(text, re.escape(name))
    return values[labels] if labels is not None else math.fsum(values.values())


def test_metrics_name_every_family_and_add_up_to_the_responses(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        probe = _post(client, "/v1/completions", LENGTH)
        text = probe[0]["choices"][0]["text"]
        assert len(text) >= 6, text
        requests = [("/v1/completions", {**LENGTH, "stream": True}),
                    ("/v1/completions", {**LENGTH, "max_tokens": 5, "n": 2}),
                    ("/v1/completions", {**LENGTH, "stop": [text[2:6]]}),
                    ("/v1/chat/completions", CHAT), ("/v1/chat/completions", {**CHAT, "stream": True})]
        answers = [probe] + [_post(client, path, body) for path, body in requests]
    finishes = [f for chunks in answers for f in _finishes(chunks)]
    assert sorted(finishes) == ["length"] * 4 + ["stop"] + ["tool_calls"] * 2, (finishes, answers)
    usages = [chunk["usage"] for chunks in answers for chunk in chunks if chunk.get("usage")]
    assert len(usages) == len(answers)
    prompt, generated = sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages)
    sequences, requests_sent = len(finishes), len(answers)

    metrics = scrape(server.url)
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", metrics, re.M))
    transfer = {name: kind for name, kind in types.items() if name.startswith(TRANSFER)}
    assert all(kind == ("counter" if name.endswith("_total") else "gauge") for name, kind in transfer.items())
    types = {name: kind for name, kind in types.items() if name not in transfer}
    assert types == FAMILIES, {"unexpected": sorted(set(types.items()) - set(FAMILIES.items())),
                               "missing": sorted(set(FAMILIES.items()) - set(types.items()))}
    model = '{model_name="tiny"}'

    by_reason = values_in(metrics, "pdserve_request_finish_total")
    assert {k: v for k, v in by_reason.items() if v} == {'{reason="length"}': 4, '{reason="stop"}': 1,
                                                         '{reason="tool_calls"}': 2}
    success = values_in(metrics, "vllm:request_success_total")
    assert success['{finished_reason="stop",model_name="tiny"}'] == 3  # tool_calls is vLLM's stop
    assert success['{finished_reason="length",model_name="tiny"}'] == 4 and sum(success.values()) == sequences
    for name in ("pdserve_prompt_tokens_total", "vllm:prompt_tokens_total", "pdserve_request_prompt_tokens_sum",
                 "vllm:request_prompt_tokens_sum"):
        assert _one(metrics, name) == prompt, name  # usage counts a prompt once for its n choices, and so do these
    for name in ("pdserve_generation_tokens_total", "vllm:generation_tokens_total",
                 "pdserve_request_generation_tokens_sum", "vllm:request_generation_tokens_sum"):
        assert _one(metrics, name) == generated, name
    assert _one(metrics, "pdserve_request_generation_tokens_count") == sequences
    assert _one(metrics, "pdserve_request_prompt_tokens_count") == requests_sent
    assert _one(metrics, "vllm:request_params_n_sum", model) == sequences  # n = 2 once, 1 for every other
    assert _one(metrics, "vllm:request_params_n_count", model) == requests_sent
    assert _one(metrics, "vllm:time_to_first_token_seconds_count", model) == requests_sent
    assert _one(metrics, "vllm:e2e_request_latency_seconds_count", model) == requests_sent
    # one sample per token after each sequence's first, though they came 4 to a delivery
    assert _one(metrics, "vllm:inter_token_latency_seconds_count", model) == generated - sequences
    assert _one(metrics, "vllm:request_time_per_output_token_seconds_count", model) == sequences
    # vLLM's queue / prefill / decode times are the phases they are made of (single-choice requests: all but n = 2)
    phases = values_in(metrics, "pdserve_request_phase_seconds_sum")

    def phase(name: str) -> float:
        return phases[f'{{phase="{name}"}}']
    traced = requests_sent - 1
    for name, parts in (("queue", ("admission", "prefill_queue")), ("prefill", ("prefill_compute",)),
                        ("decode", ("kv_transfer", "decode_join", "first_decode_step", "decode"))):
        assert _one(metrics, f"vllm:request_{name}_time_seconds_count", model) == traced, name
        assert _one(metrics, f"vllm:request_{name}_time_seconds_sum", model) == pytest.approx(
            math.fsum(phase(p) for p in parts), rel=1e-6, abs=1e-6), name
    assert phase("kv_transfer") > 0 and phase("prefill_compute") > 0  # disaggregated: both workers measured
    steps = values_in(metrics, "vllm:iteration_tokens_total_count")  # one series per worker, each stepped
    assert len(steps) == 2 and all(v > 0 for v in steps.values()), steps
    queried = values_in(metrics, "vllm:prefix_cache_queries_total")  # prompts are looked up where prefilled
    assert queried['{engine="prefill-0",model_name="tiny"}'] > 0, queried


ENGINES = ("decode-0", "prefill-0")  # the series' engine labels, in the order they are exported


def _per_engine(text: str, name: str, **labels: str) -> dict[str, float]:
    """{engine: value} of a vLLM per-engine series (model tiny), with the other `labels` given."""
    values = values_in(text, re.escape(name))
    extra = "".join(f',{k}="{v}"' for k, v in sorted(labels.items()))
    return {e: values[f'{{engine="{e}",model_name="tiny"{extra}}}'] for e in (*ENGINES, "admission")
            if f'{{engine="{e}",model_name="tiny"{extra}}}' in values}


def test_iteration_tokens_count_steps_and_tokens_as_vllms_test_does(server):
    """vLLM's test_metrics_counts: after N sequential completions of a P-token prompt with max_tokens M, the
    histogram's _sum grew by N * (P + M) and its _count by N * M, summed over the engines (here the prefill worker
    samples each first token with its prompt, the decode worker the M - 1 others), in vLLM's buckets."""
    n, m, prompt = 3, 10, [5, 17, 300, 1200, 44, 9]
    buckets = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

    def figures() -> tuple[float, float, dict[str, float]]:
        text = scrape(server.url)
        counts = values_in(text, re.escape("vllm:iteration_tokens_total_bucket"))
        by_le = {le: math.fsum(v for k, v in counts.items() if f'le="{le}"' in k) for le in ("1.0", "8.0", "+Inf")}
        return _one(text, "vllm:iteration_tokens_total_sum"), _one(text, "vllm:iteration_tokens_total_count"), by_le
    text = scrape(server.url)
    les = {re.search(r'le="([^"]+)"', line).group(1)
           for line in text.splitlines() if line.startswith("vllm:iteration_tokens_total_bucket")}
    assert les == {str(float(b)) for b in buckets} | {"+Inf"}, les  # vLLM's buckets
    # the baseline once the earlier tests' last steps are in: the workers idle, two scrapes a second apart agree (CI
    # once took it before one of their steps was reported, and counted that step here)
    wait_for_idle_workers(server.url)
    seen: list[tuple[float, float, dict[str, float]]] = []

    def settled() -> bool:
        seen.append(figures())
        return len(seen) > 1 and seen[-1][:2] == seen[-2][:2]
    poll(settled, 30, interval_s=1.0)
    sum0, count0, le0 = seen[-1]
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for _ in range(n):
            _post(client, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": m, "ignore_eos": True})
    # the engines' step counts reach the coordinator with their next stats report: wait until every step is in
    # (a loaded CI scraped 8 decode steps short); a count past it still fails below
    poll(lambda: figures()[1] - count0 >= n * m, 30)
    sum1, count1, le1 = figures()
    assert (sum1 - sum0, count1 - count0) == (n * (len(prompt) + m), n * m)
    # each prompt step carried 7 tokens (le=8), each decode step 1 (le=1)
    assert (le1["1.0"] - le0["1.0"], le1["8.0"] - le0["8.0"], le1["+Inf"] - le0["+Inf"]) == (n * (m - 1), n * m, n * m)


def test_running_counts_each_engines_batch_and_waiting_has_vllms_reasons(server):
    """vLLM's test_abort_metrics_reset reads vllm:num_requests_running's first series: > 0 while requests generate,
    0 once they are cancelled, as vllm:num_requests_waiting and vllm:kv_cache_usage_perc are. Here each engine has
    its series (decode first: the running batch is the decode worker's; the prefill worker's is empty between
    prompts), not one count of the requests booked; waiting is split by vLLM's two reasons, which add up to it."""
    streams = 2

    async def run() -> str:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            started, release = asyncio.Event(), asyncio.Event()
            counted: list[int] = []

            async def one() -> None:
                body = {"model": "tiny", "prompt": "The sea", "max_tokens": 400, "ignore_eos": True, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    chunks = 0
                    async for line in r.aiter_lines():
                        chunks += line.startswith("data: {")
                        if chunks == 3:
                            counted.append(chunks)
                            if len(counted) == streams:
                                started.set()
                            await release.wait()
                            return  # leaving the block closes the stream: the client cancels it
            tasks = [asyncio.create_task(one()) for _ in range(streams)]
            await asyncio.wait_for(started.wait(), 60)
            during = await asyncio.to_thread(scrape, server.url)
            release.set()
            await asyncio.gather(*tasks)
            return during
    during = asyncio.run(run())
    running = _per_engine(during, "vllm:num_requests_running")
    assert running == {"decode-0": streams, "prefill-0": 0}, running
    first = re.search(r"^vllm:num_requests_running\{([^}]*)\} (\S+)$", during, re.M)
    assert 'engine="decode-0"' in first.group(1) and float(first.group(2)) > 0  # what vLLM's test reads
    assert _per_engine(during, "vllm:kv_cache_usage_perc")["decode-0"] > 0
    def idle() -> str | None:  # the cancelled streams end, and their blocks are freed (the prefill worker's pinned
        text = scrape(server.url)  # prompt blocks a moment after the decode side's), within a bound
        busy = any(_per_engine(text, "vllm:num_requests_running").values()) or \
            any(_per_engine(text, "vllm:kv_cache_usage_perc").values())
        return None if busy else text
    after = poll(idle, 30) or scrape(server.url)
    assert _per_engine(after, "vllm:num_requests_running") == {"decode-0": 0, "prefill-0": 0}
    assert _per_engine(after, "vllm:kv_cache_usage_perc") == {"decode-0": 0, "prefill-0": 0}
    waiting = _per_engine(after, "vllm:num_requests_waiting")
    assert waiting == {"decode-0": 0, "prefill-0": 0, "admission": 0}, waiting
    for text in (during, after):
        reasons = {r: _per_engine(text, "vllm:num_requests_waiting_by_reason", reason=r)
                   for r in ("capacity", "deferred")}
        assert set(reasons["capacity"]) == set(reasons["deferred"]) == {*ENGINES, "admission"}, reasons
        total = _per_engine(text, "vllm:num_requests_waiting")
        assert {e: reasons["capacity"][e] + reasons["deferred"][e] for e in total} == total
