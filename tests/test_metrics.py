"""The /metrics exposition through prometheus-client: it parses with prometheus_client's own text parser, keeps the
names, labels and histogram buckets of pdserve's figures, carries vLLM's names for dashboards, prints no `_created`
series, builds per-worker gauges afresh at each scrape (a dead worker's gauges disappear), survives a failing
backend.stats(), keeps each app's figures apart (one registry per app, several apps in one process), and is rendered
for /metrics a family at a time with the event loop given back in between (each sequence's shape and vLLM's other
families: tests/test_request_metrics.py)."""

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.api.app import create_app
from coordinator.config.settings import ServerSettings
from coordinator.observability import metrics as metrics_module
from coordinator.observability.metrics import ITL_BUCKETS, LATENCY_BUCKETS, PHASE_BUCKETS, Metrics
from coordinator.observability.phases import PHASES
from engine import LLM
from tests.inprocess_backend import InProcessBackend, run_asgi

pytestmark = pytest.mark.timeout(120)
WORKER = {"name": "p0", "role": "prefill", "running": 1, "queued_prompt_tokens": 7, "free_blocks": 25,
          "total_blocks": 100, "alive": True, "state": "live",
          "engine": {"preemptions_total": 3, "steps": 9, "scheduled_tokens_total": 40, "prefix_query_tokens_total": 30,
                     "prefix_hit_tokens_total": 16, "num_waiting": 0, "num_reserved": 0,
                     "iteration_tokens_total": 45},
          # steps by tokens, in engine.load.ITERATION_TOKEN_BUCKETS' buckets: 6 of one token, 2 of <= 16, 1 above all
          "iteration_token_counts": [6, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]}
DECODE = {**WORKER, "name": "d0", "role": "decode", "free_blocks": 90, "running": 3,
          "engine": {**WORKER["engine"], "num_waiting": 5, "num_reserved": 2}}
STATS = {"queue_length": 2, "in_flight": 4, "transfer": {"bytes_total": 4096, "last latency s": 0.01, "peer": "x"},
         "workers": [WORKER, DECODE],
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
    assert got[("vllm:kv_cache_usage_perc", frozenset({model, ("engine", "p0")}))] == 0.75
    assert got[("vllm:kv_cache_usage_perc", frozenset({model, ("engine", "d0")}))] == pytest.approx(0.1)


def test_vllm_scheduler_families_per_engine_as_vllm_defines_them():
    """vllm:num_requests_running is each engine's running batch (not the 4 requests in flight); waiting splits into
    vLLM's two reasons, an engine's queue (capacity) and its KV handoffs (deferred), the admission queue an engine of
    its own; vllm:iteration_tokens_total has vLLM's buckets, cumulative, from each engine's counts."""
    _, got = scrape(watched(STATS))
    model = ("model_name", "tiny")

    def one(name: str, engine: str, **labels: str) -> float:
        return got[(name, frozenset({model, ("engine", engine), *labels.items()}))]
    assert (one("vllm:num_requests_running", "p0"), one("vllm:num_requests_running", "d0")) == (1, 3)
    assert not any(n == "vllm:num_requests_running" and ("engine", "admission") in labels for n, labels in got)
    for engine, capacity, deferred in (("p0", 0, 0), ("d0", 5, 2), ("admission", 2, 0)):
        assert one("vllm:num_requests_waiting_by_reason", engine, reason="capacity") == capacity, engine
        assert one("vllm:num_requests_waiting_by_reason", engine, reason="deferred") == deferred, engine
        assert one("vllm:num_requests_waiting", engine) == capacity + deferred, engine
    buckets = {float(dict(labels)["le"]): v for (n, labels), v in got.items()
               if n == "vllm:iteration_tokens_total_bucket" and ("engine", "p0") in labels}
    assert sorted(buckets) == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, float("inf")]
    assert (buckets[1], buckets[8], buckets[16], buckets[16384], buckets[float("inf")]) == (6, 6, 8, 8, 9)
    assert one("vllm:iteration_tokens_total_count", "p0") == 9 and one("vllm:iteration_tokens_total_sum", "p0") == 45


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
