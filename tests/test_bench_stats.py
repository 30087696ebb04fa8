"""The benchmark's metric maths on known timestamps, the phase table, its workloads and its arrival processes."""

import json
import math
import statistics

import numpy as np
import pytest

from benchclient.arrivals import ArrivalSpec, send_times
from benchclient.client import RequestResult, SSEParser
from benchclient.phase_table import format_phase_table, phase_summary
from benchclient.stats import SLO, percentile, summarize
from benchclient.workload import WorkloadSpec, build_requests


def _result(start, chunks, end, tokens, error=None, warmup=False, prompt_tokens=10):
    return RequestResult(start=start, input_len=8, max_tokens=tokens, warmup=warmup, chunk_times=list(chunks),
                         end=end, prompt_tokens=prompt_tokens, completion_tokens=tokens, tokens_from_usage=True,
                         error=error)


def test_summary_of_known_timestamps():
    results = [
        _result(-1.0, [-0.5], -0.4, 4, warmup=True),                # warm-up: left out of everything
        _result(0.0, [0.1, 0.2, 0.3, 0.5], 0.5, 5),                 # ttft 100 ms, tpot 100 ms, meets the SLOs
        _result(1.0, [1.3, 1.35], 1.4, 3),                          # ttft 300 ms: misses the TTFT SLO
        _result(2.0, [], 2.5, 0, error="HTTP 503: busy", prompt_tokens=None),  # failed: counted, not dropped
    ]
    s = summarize(results, SLO(ttft_ms=200, tpot_ms=150))
    assert (s["requests"], s["completed"], s["failed"], s["warmup_requests"]) == (3, 2, 1, 1)
    assert s["errors"] == {"HTTP 503": 1}
    assert s["duration_s"] == pytest.approx(2.5)
    assert s["request_throughput"] == pytest.approx(2 / 2.5)
    assert s["output_token_throughput"] == pytest.approx(8 / 2.5)
    assert s["total_token_throughput"] == pytest.approx(28 / 2.5)
    assert s["goodput"] == pytest.approx(1 / 2.5)
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    assert s["ttft_mean_ms"] == pytest.approx(200)
    assert s["ttft_p50_ms"] == pytest.approx(200)
    assert s["ttft_p90_ms"] == pytest.approx(280)
    assert s["tpot_p50_ms"] == pytest.approx(75)            # (0.4 / 4 + 0.1 / 2) / 2
    assert s["itl_mean_ms"] == pytest.approx(112.5)         # gaps 100, 100, 200 and 50 ms
    assert s["itl_p50_ms"] == pytest.approx(100)
    assert s["itl_p99_ms"] == pytest.approx(197)
    assert s["e2e_p50_ms"] == pytest.approx(450)
    assert s["completion_tokens_mean"] == pytest.approx(4)


def test_tpot_divides_by_tokens_not_chunks_and_single_tokens_meet_tpot():
    r = _result(0.0, [0.2, 0.6], 0.6, 9)  # two chunks carried nine tokens
    assert r.tpot == pytest.approx(0.4 / 8)
    assert r.itl == pytest.approx([0.4])
    single = _result(0.0, [0.05], 0.05, 1)
    assert single.tpot is None
    assert SLO(ttft_ms=100, tpot_ms=1).met_by(single)
    assert not SLO(ttft_ms=100, tpot_ms=1).met_by(r)


def test_no_successful_request_gives_nan_figures_not_a_crash():
    s = summarize([_result(0.0, [], 1.0, 0, error="ReadTimeout: x")], SLO())
    assert s["failed"] == 1 and s["goodput"] == 0 and math.isnan(s["ttft_p50_ms"])


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.exponential(size=n).tolist()
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_sse_events_are_stamped_when_their_last_byte_arrives():
    p = SSEParser()
    assert p.feed(b'data: {"a": 1}\n\ndata: {"b"', 1.0) == [(1.0, '{"a": 1}')]
    assert p.feed(b": 2}\r\n\r\n", 2.0) == [(2.0, '{"b": 2}')]
    assert p.feed(b"data: [DONE]\n", 3.0) == []
    assert p.feed(b"\n", 4.0) == [(4.0, "[DONE]")]


def test_slo_rejects_bad_values():
    with pytest.raises(ValueError, match="ttft_ms"):
        SLO(ttft_ms=0)
    with pytest.raises(ValueError, match="tpot_ms"):
        SLO(tpot_ms="fast")


def test_poisson_and_gamma_arrivals_have_the_asked_rate_and_spread():
    for kind, shape in (("poisson", 1.0), ("gamma", 0.25), ("gamma", 4.0)):
        times = send_times(ArrivalSpec(kind=kind, rate=10.0, burstiness=shape, seed=3), horizon_s=2000)
        gaps = np.diff(times)
        assert times[0] == 0 and times[-1] < 2000
        assert np.mean(gaps) == pytest.approx(0.1, rel=0.05)
        assert np.std(gaps) / np.mean(gaps) == pytest.approx(1 / math.sqrt(shape), rel=0.1)
    assert len(send_times(ArrivalSpec(rate=10.0), math.inf, limit=7)) == 7
    with pytest.raises(ValueError, match="positive rate"):
        ArrivalSpec(kind="poisson")
    with pytest.raises(ValueError, match="concurrency"):
        ArrivalSpec(kind="concurrency", concurrency=0)


def test_synthetic_workloads():
    fixed = build_requests(WorkloadSpec(kind="fixed", input_len=5, output_len=3, prompt_format="ids"), 4)
    assert [len(r.prompt) for r in fixed] == [5] * 4 and {r.max_tokens for r in fixed} == {3}
    text = build_requests(WorkloadSpec(kind="fixed", input_len=6), 2)
    assert len(text[0].prompt.split()) == 6 and text[0].prompt != text[1].prompt
    assert build_requests(WorkloadSpec(kind="fixed", seed=1), 3) == build_requests(WorkloadSpec(seed=1), 3)
    uniform = build_requests(WorkloadSpec(kind="uniform", input_len=20, output_len=10, min_len=4), 300)
    assert min(r.input_len for r in uniform) == 4 and max(r.input_len for r in uniform) == 20
    assert {r.max_tokens for r in uniform} == set(range(4, 11))
    chat = build_requests(WorkloadSpec(kind="chat", input_len=100, output_len=50, max_input_len=2000), 2000)
    lengths = [r.input_len for r in chat]
    assert statistics.median(lengths) == pytest.approx(100, rel=0.1)
    assert max(lengths) == 2000 and statistics.mean(lengths) > 1.3 * statistics.median(lengths)  # long tail


def test_file_workloads(tmp_path):
    jsonl = tmp_path / "w.jsonl"
    jsonl.write_text('{"prompt": "hello there", "max_tokens": 7}\n\n'
                     '{"messages": [{"role": "user", "content": "hi you"}]}\n')
    reqs = build_requests(WorkloadSpec(kind="jsonl", path=str(jsonl), output_len=9), 3)
    assert [r.max_tokens for r in reqs] == [7, 9, 7] and reqs[1].prompt[0]["content"] == "hi you"
    share = tmp_path / "sg.json"
    share.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "why is the sky blue"}, {"from": "gpt", "value": "x" * 40}]},
        {"conversations": [{"from": "human", "value": "alone"}]}]))
    (req,) = build_requests(WorkloadSpec(kind="sharegpt", path=str(share)), 1)
    assert (req.prompt, req.input_len, req.max_tokens) == ("why is the sky blue", 5, 10)
    jsonl.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"w\.jsonl:2: not valid JSON"):
        build_requests(WorkloadSpec(kind="jsonl", path=str(jsonl)), 1)
    with pytest.raises(ValueError, match="needs a path"):
        WorkloadSpec(kind="sharegpt")


def test_phase_shares_count_a_missing_phase_as_zero_and_leave_out_requests_without_phases():
    rs = [_result(0.0, [0.1], 1.0, 2), _result(0.0, [0.1], 1.0, 2), _result(0.0, [0.1], 1.0, 2),
          _result(0.0, [0.1], 1.0, 2, warmup=True), _result(0.0, [], 1.0, 0, error="HTTP 500")]
    rs[0].phases = {"ingress": 0.1, "decode": 0.3}                      # shares 25% / 75%
    rs[1].phases = {"ingress": 0.2, "decode": 0.2, "migration": 0.4}   # 25% / 25% / 50%
    rs[3].phases = rs[4].phases = {"ingress": 9.0}                     # warm-up and failed: left out
    s = phase_summary(rs)
    assert s["requests"] == 2 and list(s["phases"]) == ["ingress", "decode", "migration"]
    assert s["server_e2e_mean_ms"] == pytest.approx(600)
    assert s["phases"]["ingress"]["mean_ms"] == pytest.approx(150) and s["phases"]["ingress"]["share_p99"] == 0.25
    assert s["phases"]["decode"]["share_mean"] == pytest.approx(0.5)
    assert s["phases"]["decode"]["share_p50"] == pytest.approx(0.5)
    assert s["phases"]["migration"]["share_mean"] == pytest.approx(0.25)
    assert s["phases"]["migration"]["share_p99"] == pytest.approx(0.495)
    table = format_phase_table(s).splitlines()
    assert table[0].startswith("where did the time go (2 requests") and len(table) == 6
    assert table[3].split() == ["decode", "250.0", "50.0%", "50.0%", "74.5%"]
    assert phase_summary(rs[2:3]) == {"requests": 0, "phases": {}} and format_phase_table({"requests": 0}) == ""
