"""Each sequence's end counted by finish reason and shape in pdserve's and vLLM's names
(coordinator.observability.request_metrics): every outcome through RequestFigures, a traced request's phases as
vLLM's queue / prefill / decode times, stop and length over an in-process engine; and vLLM's per-engine families
from the workers' engine counters (coordinator.observability.vllm_engine). On a real server:
tests/test_metrics_serving.py."""

import pytest

from coordinator.api.app import create_app
from coordinator.config.settings import ServerSettings
from coordinator.observability.metrics import Metrics
from coordinator.observability.request_metrics import Parent, SequenceEnd
from engine import LLM
from tests.inprocess_backend import InProcessBackend, run_asgi
from tests.test_metrics import STATS, samples, scrape, watched

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine(checkpoints):
    return LLM(str(checkpoints.tiny()), max_model_len=64).engine


def test_vllm_engine_families_come_from_each_workers_engine_counters():
    text, got = scrape(watched(STATS))
    for worker in ("p0", "d0"):
        labels = frozenset({"model_name": "tiny", "engine": worker}.items())
        assert got[("vllm:num_preemptions_total", labels)] == 3
        assert got[("vllm:prefix_cache_queries_total", labels)] == 30
        assert got[("vllm:prefix_cache_hits_total", labels)] == 16
        assert got[("vllm:iteration_tokens_total_count", labels)] == 9  # engine steps that produced tokens
        assert got[("vllm:iteration_tokens_total_sum", labels)] == 45   # their prompts completed and tokens sampled
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
