"""The /metrics exposition through prometheus-client: it parses with prometheus_client's own text parser, keeps the
names, labels and histogram buckets of pdserve's figures, carries vLLM's names for dashboards, prints no `_created`
series, builds per-worker gauges afresh at each scrape (a dead worker's gauges disappear), survives a failing
backend.stats(), keeps each app's figures apart (one registry per app, several apps in one process), and is rendered
for /metrics a family at a time with the event loop given back in between. Each sequence's end is counted by finish
reason and shape in pdserve's and vLLM's names (stop and length over an in-process engine; every outcome through
RequestFigures), and vLLM's per-engine families come from the workers' engine counters."""

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.api.app import create_app
from coordinator.config.settings import ServerSettings
from coordinator.observability import metrics as metrics_module
from coordinator.observability.metrics import ITL_BUCKETS, LATENCY_BUCKETS, PHASE_BUCKETS, Metrics
from coordinator.observability.phases import PHASES
from coordinator.observability.request_metrics import Parent, SequenceEnd
from engine import LLM
from tests.inprocess_backend import InProcessBackend, run_asgi

pytestmark = pytest.mark.timeout(120)
WORKER = {"name": "p0", "role": "prefill", "running": 1, "queued_prompt_tokens": 7, "free_blocks": 25,
          "total_blocks": 100, "alive": True, "state": "live",
          "engine": {"preemptions_total": 3, "steps": 9, "scheduled_tokens_total": 40, "prefix_query_tokens_total": 30,
                     "prefix_hit_tokens_total": 16}}
STATS = {"queue_length": 2, "in_flight": 4, "transfer": {"bytes_total": 4096, "last latency s": 0.01, "peer": "x"},
         "workers": [WORKER, {**WORKER, "name": "d0", "role": "decode", "free_blocks": 90}],
         "errors": {"transfer": 2}, "prefix_affinity_hits": 5, "mode": "disaggregated",
         "coordinator": {"loop_lag_seconds": 0.004, "loop_stalls_total": 3, "gc_pause_max_s": 0.02},
         "migrations": {"attempted": 1}, "waiting_by_priority": {1: 2}}


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, label set): value}, parsed by prometheus_client (which raises on a malformed exposition)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(metrics: Metrics) -> tuple[str, dict]:
    text = metrics.exposition().decode()
    return text, samples(text)


def watched(stats, tenants=None) -> Metrics:
    m = Metrics("tiny")
    source = SimpleNamespace(stats=stats if callable(stats) else lambda: stats)
    m.watch(source, SimpleNamespace(in_flight=3, draining=False), tenants)
    return m


def test_exposition_parses_with_the_names_labels_and_buckets_of_pdserve():
    m = watched(STATS, SimpleNamespace(usage=lambda: {"bulk": {"requests_finished": 2, "prompt_tokens": 10}}))
    for v in (0.002, 0.3, 100.0):
        m.ttft.observe(v)
    m.requests.inc("finished")
    m.errors.inc("invalid_request")
    m.prompt_tokens.inc(12)
    text, got = scrape(m)
    w = frozenset({"worker": "p0", "role": "prefill"}.items())
    assert got[("pdserve_time_to_first_token_seconds_bucket", frozenset({"le": "0.0025"}.items()))] == 1
    assert got[("pdserve_time_to_first_token_seconds_bucket", frozenset({"le": "+Inf"}.items()))] == 3
    assert got[("pdserve_time_to_first_token_seconds_count", frozenset())] == 3
    for name, buckets in (("pdserve_time_to_first_token_seconds", LATENCY_BUCKETS),
                          ("pdserve_inter_token_latency_seconds", ITL_BUCKETS),
                          ("pdserve_e2e_request_latency_seconds", LATENCY_BUCKETS)):
        les = sorted(float(dict(labels)["le"]) for n, labels in got if n == name + "_bucket")
        assert les == [*buckets, float("inf")], name
    assert got[("pdserve_requests_total", frozenset({"outcome": "finished"}.items()))] == 1
    assert got[("pdserve_requests_total", frozenset({"outcome": "aborted"}.items()))] == 0  # preset outcomes
    assert got[("pdserve_errors_total", frozenset({"kind": "invalid_request"}.items()))] == 1
    assert got[("pdserve_prompt_tokens_total", frozenset())] == 12
    assert got[("pdserve_queue_length", frozenset())] == 2 and got[("pdserve_requests_in_flight", frozenset())] == 3
    assert got[("pdserve_worker_kv_usage_ratio", w)] == 0.75 and got[("pdserve_worker_alive", w)] == 1
    assert got[("pdserve_worker_state", frozenset({"worker": "p0", "role": "prefill", "state": "live"}.items()))] == 1
    assert got[("pdserve_worker_engine_preemptions_total", w)] == 3 and got[("pdserve_worker_engine_steps", w)] == 9
    assert "# TYPE pdserve_transfer_bytes_total counter" in text and got[("pdserve_transfer_bytes_total", frozenset())]
    assert got[("pdserve_transfer_last_latency_s", frozenset())] == 0.01 and "peer" not in text
    assert got[("pdserve_backend_errors_total", frozenset({"kind": "transfer"}.items()))] == 2
    assert got[("pdserve_migrations_total", frozenset({"event": "attempted"}.items()))] == 1
    assert got[("pdserve_prefix_affinity_hits_total", frozenset())] == 5 and "disaggregated" not in text
    assert got[("pdserve_coordinator_loop_lag_seconds", frozenset())] == 0.004
    assert got[("pdserve_coordinator_loop_stalls_total", frozenset())] == 3
    assert got[("pdserve_coordinator_gc_pause_max_s", frozenset())] == 0.02
    assert got[("pdserve_queue_length_by_priority", frozenset({"priority": "1"}.items()))] == 2
    assert got[("pdserve_tenant_requests_total", frozenset({"tenant": "bulk", "outcome": "finished"}.items()))] == 2
    assert got[("pdserve_tenant_prompt_tokens_total", frozenset({"tenant": "bulk"}.items()))] == 10
    assert "_created" not in text


def test_vllm_aliases_carry_the_same_figures_labelled_with_the_model():
    m = watched(STATS)
    m.ttft.observe(0.02)
    m.e2e.observe(0.5)
    m.itl.observe(0.01)
    m.prompt_tokens.inc(7)
    m.generation_tokens.inc(5)
    _, got = scrape(m)
    model = ("model_name", "tiny")
    for ours, theirs in (("pdserve_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
                         ("pdserve_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"),
                         ("pdserve_inter_token_latency_seconds", "vllm:inter_token_latency_seconds")):
        mine = {(n.replace(ours, theirs), labels | {model}): v for (n, labels), v in got.items() if n.startswith(ours)}
        assert mine and all(got[key] == v for key, v in mine.items()), theirs
    assert got[("vllm:prompt_tokens_total", frozenset({model}))] == 7
    assert got[("vllm:generation_tokens_total", frozenset({model}))] == 5
    assert got[("vllm:num_requests_running", frozenset({model}))] == 4  # placed on workers
    assert got[("vllm:num_requests_waiting", frozenset({model}))] == 2
    assert got[("vllm:kv_cache_usage_perc", frozenset({model, ("engine", "p0")}))] == 0.75
    assert got[("vllm:kv_cache_usage_perc", frozenset({model, ("engine", "d0")}))] == pytest.approx(0.1)


def test_per_worker_gauges_are_built_at_each_scrape_and_a_dead_workers_disappear():
    current = {"stats": STATS}
    m = watched(lambda: current["stats"])
    _, before = scrape(m)
    assert ("pdserve_worker_running", frozenset({"worker": "d0", "role": "decode"}.items())) in before
    dead = {**WORKER, "name": "d0", "role": "decode", "alive": False, "state": "dead"}
    for key in ("running", "queued_prompt_tokens", "free_blocks", "engine"):  # what backend_stats leaves out
        dead.pop(key)
    current["stats"] = {**STATS, "workers": [WORKER, dead]}
    _, after = scrape(m)
    d0 = {(n, labels) for n, labels in after if ("worker", "d0") in labels or ("engine", "d0") in labels}
    assert {n for n, _ in d0} == {"pdserve_worker_total_blocks", "pdserve_worker_alive", "pdserve_worker_state"}
    assert after[("pdserve_worker_alive", frozenset({"worker": "d0", "role": "decode"}.items()))] == 0
    current["stats"] = {**STATS, "workers": [WORKER]}  # removed from the pool: nothing of it is left
    _, gone = scrape(m)
    assert not any(("worker", "d0") in labels for _, labels in gone)


def test_a_failing_backend_stats_is_counted_and_the_scrape_still_answers():
    def broken():
        raise RuntimeError("actor died")
    m = watched(broken)
    for n in (1, 2):
        _, got = scrape(m)
        assert got[("pdserve_backend_stats_errors", frozenset())] == n
        assert got[("pdserve_requests_in_flight", frozenset())] == 3
        assert not any(name.startswith(("pdserve_worker_", "vllm:num_requests")) for name, _ in got)


def test_two_sets_of_metrics_in_one_process_keep_their_own_figures():
    a, b = watched(STATS), watched(STATS)
    a.requests.inc("failed")
    a.ttft.observe(0.1)
    _, got_a = scrape(a)
    _, got_b = scrape(b)
    key = ("pdserve_requests_total", frozenset({"outcome": "failed"}.items()))
    assert got_a[key] == 1 and got_b[key] == 0
    assert got_b[("pdserve_time_to_first_token_seconds_count", frozenset())] == 0


@pytest.fixture(scope="module")
def engine(checkpoints):
    return LLM(str(checkpoints.tiny()), max_model_len=64).engine


def test_metrics_endpoint_after_a_request_parses_and_counts_it(engine, checkpoints):
    backend = InProcessBackend(engine, checkpoints.tiny())

    async def fn(client):
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3,
                                                       "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return await client.get("/metrics")
    r = run_asgi(create_app(backend, ServerSettings()), backend, fn)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    got = samples(r.text)
    model = ("model_name", "tiny")
    assert got[("pdserve_requests_total", frozenset({"outcome": "finished"}.items()))] == 1
    assert got[("pdserve_generation_tokens_total", frozenset())] == 3
    assert got[("vllm:generation_tokens_total", frozenset({model}))] == 3
    assert got[("vllm:time_to_first_token_seconds_count", frozenset({model}))] == 1
    assert ("vllm:kv_cache_usage_perc", frozenset({model, ("engine", "inprocess-0")})) in got


def test_phase_histograms_preset_every_phase_with_their_buckets():
    m = watched(STATS)
    m.phases.labels("decode").observe(0.3)
    _, got = scrape(m)
    counts = {dict(labels)["phase"]: v for (n, labels), v in got.items() if n == "pdserve_request_phase_seconds_count"}
    assert counts == {p: (1 if p == "decode" else 0) for p in PHASES}
    les = sorted(float(dict(labels)["le"]) for n, labels in got
                 if n == "pdserve_request_phase_seconds_bucket" and dict(labels)["phase"] == "ingress")
    assert les == [*PHASE_BUCKETS, float("inf")]
    assert got[("pdserve_request_phase_seconds_bucket", frozenset({"phase": "decode", "le": "0.25"}.items()))] == 0
    assert got[("pdserve_request_phase_seconds_bucket", frozenset({"phase": "decode", "le": "0.5"}.items()))] == 1


def test_the_scrape_rendered_a_family_at_a_time_is_the_same_text_and_gives_the_loop_back(monkeypatch):
    m = watched(STATS)
    m.ttft.observe(0.02)
    m.requests.inc("finished", 2)
    monkeypatch.setattr(metrics_module, "YIELD_EVERY_S", 0.0)  # give the loop back after every family

    async def scrape_beside_another_task() -> tuple[bytes, int]:
        turns = 0

        async def other() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)
        task = asyncio.create_task(other())
        await asyncio.sleep(0)
        started = turns
        text = await m.exposition_async()
        task.cancel()
        return text, turns - started
    text, turns = asyncio.run(scrape_beside_another_task())
    assert text == m.exposition()
    families = len(list(text_string_to_metric_families(text.decode())))
    assert turns >= families // 2  # the other task ran while the scrape was rendered, not only after it


def test_vllm_engine_families_come_from_each_workers_engine_counters():
    text, got = scrape(watched(STATS))
    for worker in ("p0", "d0"):
        labels = frozenset({"model_name": "tiny", "engine": worker}.items())
        assert got[("vllm:num_preemptions_total", labels)] == 3
        assert got[("vllm:prefix_cache_queries_total", labels)] == 30
        assert got[("vllm:prefix_cache_hits_total", labels)] == 16
        assert got[("vllm:iteration_tokens_total_count", labels)] == 9  # engine steps
        assert got[("vllm:iteration_tokens_total_sum", labels)] == 40   # tokens they computed
        assert got[("vllm:iteration_tokens_total_bucket", labels | {("le", "+Inf")})] == 9
    for line in ("# TYPE vllm:num_preemptions_total counter", "# TYPE vllm:prefix_cache_hits_total counter",
                 "# TYPE vllm:iteration_tokens_total histogram"):
        assert line in text


def test_request_figures_count_every_outcome_with_pdserve_and_vllm_reasons():
    m = Metrics("tiny", max_model_len=64)
    for outcome, finish, tokens in (("finished", "tool_calls", 5), ("finished", "length", 8), ("aborted", None, 2),
                                    ("timeout", "length", 3), ("failed", None, 0), ("rejected", None, 0)):
        m.sequences.observe(SequenceEnd(outcome, finish, 7, tokens, 8, 1.0 if tokens else None, 1.0 + tokens / 10
                                        if tokens else None, True, None))
    parent = Parent(3)  # one prompt, n = 3: n and the longest choice are observed once, when the last choice ends
    for tokens in (4, 6, 5):
        m.sequences.observe(SequenceEnd("finished", "stop", 7, tokens, 8, 1.0, 1.5, tokens == 4, None), parent)
    _, got = scrape(m)
    model = ("model_name", "tiny")
    reasons = {dict(labels)["reason"]: v for (n, labels), v in got.items() if n == "pdserve_request_finish_total"}
    assert reasons == {"stop": 3, "length": 1, "tool_calls": 1, "abort": 1, "timeout": 1, "error": 1}
    vllm = {dict(labels)["finished_reason"]: v for (n, labels), v in got.items() if n == "vllm:request_success_total"}
    assert vllm == {"stop": 4, "length": 1, "abort": 2, "error": 1}  # tool_calls is a stop, a timeout an abort
    assert got[("pdserve_request_generation_tokens_count", frozenset())] == 8  # the rejected one never ran
    assert got[("pdserve_request_generation_tokens_sum", frozenset())] == 5 + 8 + 2 + 3 + 4 + 6 + 5
    assert got[("pdserve_request_prompt_tokens_count", frozenset())] == 6      # once per prompt
    assert got[("vllm:request_generation_tokens_count", frozenset({model}))] == 8
    assert got[("vllm:request_params_n_count", frozenset({model}))] == 6
    assert got[("vllm:request_params_n_bucket", frozenset({model, ("le", "2.0")}))] == 5
    assert got[("vllm:request_max_num_generation_tokens_sum", frozenset({model}))] == 5 + 8 + 2 + 3 + 0 + 6
    assert got[("vllm:request_params_max_tokens_sum", frozenset({model}))] == 8 * 8
    tpot = got[("vllm:request_time_per_output_token_seconds_sum", frozenset({model}))]
    assert got[("vllm:request_time_per_output_token_seconds_count", frozenset({model}))] == 7  # those with a token
    assert tpot == pytest.approx(0.5 / 4 + 0.8 / 7 + 0.2 + 0.3 / 2 + 0.5 / 3 + 0.5 / 5 + 0.5 / 4)
    les = sorted(float(dict(labels)["le"]) for n, labels in got if n == "pdserve_request_prompt_tokens_bucket")
    assert les == [1, 2, 5, 10, 20, 50, float("inf")]  # vLLM's 1-2-5 buckets up to max_model_len


def test_a_traced_request_maps_its_phases_to_vllms_queue_prefill_and_decode_times():
    m = Metrics("tiny")
    phases = {"ingress": 0.01, "admission": 0.3, "prefill_queue": 0.2, "prefill_compute": 0.7, "kv_transfer": 0.1,
              "decode_join": 0.05, "first_decode_step": 0.05, "decode": 1.3, "migration": 4.0, "overhead": 2.0}
    m.sequences.observe(SequenceEnd("finished", "stop", 7, 9, 16, 1.0, 2.0, True, phases))
    _, got = scrape(m)
    model = frozenset({("model_name", "tiny")})
    for name, seconds in (("queue", 0.5), ("prefill", 0.7), ("decode", 1.5), ("inference", 2.2)):
        assert got[(f"vllm:request_{name}_time_seconds_sum", model)] == pytest.approx(seconds), name
        assert got[(f"vllm:request_{name}_time_seconds_count", model)] == 1


def test_inprocess_requests_are_counted_per_sequence_with_their_finish_and_shape(engine, checkpoints):
    backend = InProcessBackend(engine, checkpoints.tiny())
    base = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}

    async def fn(client):
        bodies = []
        for extra in ({}, {"stream": True}):  # (n > 1 needs generate_group: the real server's test)
            r = await client.post("/v1/completions", json={**base, **extra})
            assert r.status_code == 200, r.text
            bodies.append(r)
        text = bodies[0].json()["choices"][0]["text"]
        stopped = await client.post("/v1/completions", json={**base, "stop": [text]})
        return bodies[0].json(), stopped.json(), (await client.get("/metrics")).text
    whole, stopped, text = run_asgi(create_app(backend, ServerSettings()), backend, fn)
    assert stopped["choices"][0]["finish_reason"] == "stop"
    got, model = samples(text), ("model_name", "tiny")
    prompt, cut = whole["usage"]["prompt_tokens"], stopped["usage"]["completion_tokens"]
    assert got[("pdserve_request_finish_total", frozenset({("reason", "length")}))] == 2
    assert got[("pdserve_request_finish_total", frozenset({("reason", "stop")}))] == 1
    assert got[("vllm:request_success_total", frozenset({model, ("finished_reason", "length")}))] == 2
    assert got[("vllm:request_success_total", frozenset({model, ("finished_reason", "stop")}))] == 1
    assert got[("pdserve_request_generation_tokens_sum", frozenset())] == 2 * 3 + cut
    assert got[("pdserve_request_prompt_tokens_sum", frozenset())] == 3 * prompt == got[("pdserve_prompt_tokens_total",
                                                                                          frozenset())]
    assert got[("vllm:request_params_n_count", frozenset({model}))] == 3
    assert got[("vllm:request_params_max_tokens_sum", frozenset({model}))] == 3 * 3
    assert got[("vllm:request_queue_time_seconds_count", frozenset({model}))] == 3  # traced
