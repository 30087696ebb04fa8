"""The `multiturn` workload of the benchmark client (benchclient.conversations, benchclient.run).

- Conversations are seeded scripts: the same spec gives the same ones; a system prompt is shared by all; a jsonl file
  of real conversations gives its user turns and, from the original replies, the output budgets; bad files and
  settings fail naming the line or the key.
- Against the real HTTP server on the tiny engine: each conversation's turns go one after the other, each turn's
  prompt the history with the server's own replies, so later turns find their history in the prefix cache (the
  server's cached_tokens > 0, the summary's cached share and later-turn TTFT), on the completions and the chat
  endpoint; the closed loop keeps at most `concurrency` conversations going.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from benchclient.arrivals import ArrivalSpec
from benchclient.cache_tiers import tier_shares
from benchclient.client import Target
from benchclient.conversations import build_conversations, turn_prompt
from benchclient.run import RunConfig, run_load, run_report
from benchclient.stats import SLO
from benchclient.workload import WorkloadSpec, build_requests
from coordinator.api.app import create_app
from coordinator.config.settings import ServerSettings
from engine import LLM
from tests.inprocess_backend import InProcessBackend, ServerThread

pytestmark = pytest.mark.timeout(120)
SPEC = WorkloadSpec(name="mt", kind="multiturn", conversations=3, turns=3, input_len=12, output_len=6, sigma=0.3,
                    max_input_len=20, max_output_len=8, system_prompt_len=24, seed=5)


def test_conversations_are_seeded_scripts_sharing_one_system_prompt():
    convs = build_conversations(SPEC)
    assert convs == build_conversations(SPEC) and convs != build_conversations(WorkloadSpec(**{**vars(SPEC),
                                                                                                "seed": 6}))
    assert [c.turns for c in convs] == [3, 3, 3] and len({c.system for c in convs}) == 1
    assert all(1 <= n <= 8 for c in convs for n in c.max_tokens) and all(t == 0 for c in convs for t in c.think_s)
    c = convs[0]
    text = turn_prompt(c, ["first reply", "second reply"], 2, chat=False)
    earlier = turn_prompt(c, ["first reply"], 1, chat=False)
    assert text == f"{earlier}second reply\n\nUser: {c.users[2]}\n\nAssistant:"  # the last prompt, its reply, more
    messages = turn_prompt(c, ["r0", "r1"], 2, chat=True)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[2]["content"] == "r0" and messages[-1]["content"] == c.users[2]
    thinking = build_conversations(WorkloadSpec(**{**vars(SPEC), "think_time_s": 0.5}))
    assert all(t > 0 for conv in thinking for t in conv.think_s)


def test_a_jsonl_of_conversations_gives_user_turns_and_budgets(tmp_path):
    path = tmp_path / "convs.jsonl"
    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
                          {"role": "assistant", "content": "one two three"}, {"role": "user", "content": "and?",
                                                                               "max_tokens": 9}]},
            {"messages": [{"role": "user", "content": "solo"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    spec = WorkloadSpec(kind="multiturn", path=str(path), conversations=3, output_len=5)
    convs = build_conversations(spec)
    assert [(c.system, c.users, c.max_tokens) for c in convs] == [
        ("be brief", ("hi there", "and?"), (3, 9)), (None, ("solo",), (5,)), ("be brief", ("hi there", "and?"), (3, 9))]
    assert build_requests(spec, 1)[0].prompt == [{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "hi there"}]
    path.write_text('{"messages": [{"role": "assistant", "content": "x"}]}\n')
    with pytest.raises(ValueError, match="convs.jsonl:1: no user message"):
        build_conversations(spec)
    for bad, key in (({"turns": 0}, "turns"), ({"conversations": -1}, "conversations"),
                     ({"think_time_s": -1}, "think_time_s"), ({"system_prompt_len": -2}, "system_prompt_len"),
                     ({"prompt_format": "ids"}, "prompt_format")):
        with pytest.raises(ValueError, match=key):
            WorkloadSpec(**{"kind": "multiturn", **bad})


@pytest.fixture(scope="module")
def server(checkpoints):
    folder = checkpoints.tiny()
    backend = InProcessBackend(LLM(str(folder), max_model_len=512).engine, folder)
    with ServerThread(create_app(backend, ServerSettings()), backend) as srv:
        yield srv


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_turns_resend_the_history_and_later_ones_find_it_cached(server, endpoint):
    cfg = RunConfig(target=Target(server.url, "tiny", endpoint=endpoint, ignore_eos=True), workload=SPEC,
                    arrival=ArrivalSpec(kind="concurrency", concurrency=2), slo=SLO(), duration_s=60, warmup_s=0)
    results = asyncio.run(run_load(cfg))
    assert len(results) == 9 and all(r.ok for r in results), [r.error for r in results]
    by_conv = {}
    for r in sorted(results, key=lambda r: r.start):
        by_conv.setdefault(r.conversation, []).append(r)
    assert sorted(by_conv) == [0, 1, 2]
    for turns in by_conv.values():
        assert [r.turn for r in turns] == [0, 1, 2]
        for before, after in zip(turns, turns[1:], strict=False):
            assert after.start >= before.end  # a turn goes after the previous reply
            assert after.prompt_tokens > before.prompt_tokens + before.completion_tokens - 2  # the history grew
            assert after.cached_tokens >= 16  # its history's leading blocks were in the prefix cache
    first_turns = sorted((r for r in results if r.turn == 0), key=lambda r: r.start)
    assert first_turns[-1].cached_tokens >= 16  # the shared system prompt (24 words; it starts after one ended)
    summary = run_report(cfg, results)["summary"]
    assert summary["conversations"] == 3 and 0 < summary["cached_prompt_tokens_ratio"] < 1
    assert summary["ttft_later_turns_p50_ms"] > 0
    starts = sorted((r.start, +1) for r in first_turns) + sorted((turns[-1].end, -1) for turns in by_conv.values())
    running = 0
    for _, step in sorted(starts):
        running += step
        assert running <= 2  # at most `concurrency` conversations at once


def test_tier_shares_are_the_counters_differences_over_the_tokens_admitted():
    """benchclient.cache_tiers (read from a real server in tests/test_serving_host_tier.py and the CPU smoke sweep)."""
    before = {"queries": 100.0, "device": 10.0, "host": 0.0}
    after = {"queries": 300.0, "device": 60.0, "host": 100.0}
    assert tier_shares(before, after) == {"cache_share_device": 0.25, "cache_share_host": 0.5}
    assert tier_shares(None, after) == {} and tier_shares(before, None) == {}
    assert tier_shares(before, before) == {}  # nothing admitted
    assert tier_shares(before, {**after, "host": 0.0, "device": 5.0}) == {}  # a replaced worker's counters restarted
