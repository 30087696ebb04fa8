"""Graphs captured after start (EngineConfig.graph_capture "deferred"; engine.runner.deferred_graphs): the engine
starts with its first decode buckets only, a larger decode bucket is captured when a step needs it, the rest between
steps; whatever is captured when, the tokens and logits are transformers', and a capture made while requests hold
KV writes nothing into their blocks. Captures need CUDA: those tests skip on the CPU; the config rules run here."""

import asyncio
import time

import pytest
import torch

from coordinator.config.pool_config import PoolConfig
from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.engine_config import EngineConfig
from engine.runner.deferred_graphs import BUSY_SPACING, DeferredGraphs
from tests.engine_helpers import LogitsRecorder, assert_greedy_matches, hf_greedy, random_prompts
from tests.test_model_exactness import vocab_size_of

LENGTHS = (5, 17, 40, 9, 23, 31, 12, 7, 19, 28, 14, 36)  # 12 streams: above the 8-row buckets captured at start
NEW_TOKENS = 6
OPTIONS = dict(device="cuda", kernels="triton", graph_capture="deferred", max_num_seqs=32, block_size=16,
               max_num_batched_tokens=256, prefill_graph_tokens=64, mixed_graph_tokens=256, warmup=False,
               enable_prefix_caching=False)


def test_pools_defer_at_one_rank_and_engines_refuse_deferred_tensor_parallel():
    assert PoolConfig().engine_graph_capture == "deferred"
    assert PoolConfig(tensor_parallel_size=2).engine_graph_capture == "start"
    assert PoolConfig(graph_capture="start").engine_graph_capture == "start"
    for bad in ("later", True):
        with pytest.raises(ValueError, match="graph_capture"):
            PoolConfig(graph_capture=bad)
    with pytest.raises(ValueError, match="graph_capture"):
        PoolConfig(graph_capture="deferred", tensor_parallel_size=2)
    assert EngineConfig().graph_capture == "start"  # the offline engine captures everything before it runs
    with pytest.raises(ValueError, match="graph_capture"):
        EngineConfig(graph_capture="deferred", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="graph_capture"):
        EngineConfig(graph_capture="auto")


class _Set:
    """A graph set as DeferredGraphs sees it: pending buckets, each capture taking `seconds`."""

    class _Pending:
        def __init__(self, n: int) -> None:
            self.pending = list(range(n))

    def __init__(self, n: int, seconds: float) -> None:
        self.deferred, self.seconds, self.captured = self._Pending(n), seconds, 0

    def capture_pending(self) -> bool:
        time.sleep(self.seconds)
        self.deferred.pending.pop(0)
        self.captured += 1
        return True


def test_idle_captures_back_to_back_busy_ones_spaced_by_their_cost():
    first, second = _Set(2, 0.01), _Set(1, 0.0)
    graphs = DeferredGraphs([first, None, second])
    assert graphs.left == 3
    assert graphs.capture_one(busy=True)  # the first busy capture goes at once
    assert not graphs.capture_one(busy=True)  # then the engine steps BUSY_SPACING times as long first
    assert graphs.capture_one(busy=False)  # idle: no wait
    assert (first.captured, second.captured) == (2, 0)
    # past the spacing the last capture set, whatever it took on this machine: it took at most all of `seconds`
    time.sleep(graphs.seconds * (BUSY_SPACING + 1))
    assert graphs.capture_one(busy=True) and second.captured == 1
    assert graphs.left == 0 and not graphs.capture_one(busy=False) and graphs.captured == 3 and graphs.seconds > 0


def _check(llm: LLM, prompts, refs) -> None:
    assert_greedy_matches(llm, prompts, refs, NEW_TOKENS, 1e-4)
    counts = llm.engine.check_integrity()
    assert counts["in_use"] == 0 and counts["pinned"] == 0


@pytest.mark.gpus(1)
def test_a_decode_bucket_is_captured_when_a_step_first_needs_it(checkpoints):
    folder = checkpoints.get("LlamaForCausalLM", num_hidden_layers=2)
    prompts = random_prompts(LENGTHS, vocab_size_of(folder), seed=11)
    refs = hf_greedy(folder, prompts, NEW_TOKENS)
    llm = LLM(str(folder), **OPTIONS)
    runner = llm.engine.runner
    assert sorted(runner.graphs.graphs) == [1, 2, 4, 8] and runner.graphs.deferred.pending == [16, 32]
    assert not runner.prefill_graphs.graphs and not runner.mixed_graphs.graphs
    llm.engine.deferred_graphs._next_busy = float("inf")  # no capture between steps: only the one a step needs
    _check(llm, prompts, refs)
    assert 16 in runner.graphs.graphs and runner.graphs.deferred.pending == [32] and runner.graphs.replays > 0
    assert not runner.prefill_graphs.graphs  # nothing else was captured: those steps ran eagerly


@pytest.mark.gpus(1)
def test_captures_while_requests_hold_kv_leave_their_blocks_alone(checkpoints):
    """Every pending graph is captured in the middle of the requests' decoding, after their prompts' KV is in the
    cache, with every static buffer made stale first (slots that would store into the requests' blocks, sequences
    with tokens and context): the warm-up runs of the captures must store nothing, so the requests continue with
    transformers' tokens; afterwards the same engine replays the graphs for new requests."""
    folder = checkpoints.get("LlamaForCausalLM", num_hidden_layers=2)
    prompts = random_prompts(LENGTHS, vocab_size_of(folder), seed=12)
    refs = hf_greedy(folder, prompts, NEW_TOKENS)
    llm = LLM(str(folder), **OPTIONS)
    engine, runner = llm.engine, llm.engine.runner
    recorder = LogitsRecorder(engine)
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True) for _ in prompts]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}

    def step() -> None:
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids

    while engine.load().num_running < len(prompts) or any(not o for o in outputs.values()):
        step()
    for graphs in (runner.graphs, runner.prefill_graphs, runner.mixed_graphs):
        graphs.slots.copy_(torch.arange(graphs.slots.shape[0]))
    runner.prefill_graphs.query_start.copy_(3 * torch.arange(runner.prefill_graphs.query_start.shape[0]))
    runner.prefill_graphs.context_lens.fill_(40)
    runner.graphs.context_lens.fill_(40)
    while engine.capture_deferred_graph(busy=False):
        pass
    load = engine.load()
    assert load.graphs_pending == 0 and load.graph_capture_s > 0
    assert sorted(runner.graphs.graphs) == [1, 2, 4, 8, 16, 32]
    assert sorted(runner.prefill_graphs.graphs) == sorted(runner.prefill_graphs.buckets.all())
    assert sorted(runner.mixed_graphs.graphs) == runner.mixed_graphs.buckets
    while engine.has_unfinished():
        step()
    for i, (p, (tokens, logits)) in enumerate(zip(params, refs, strict=True)):
        assert outputs[f"r{i}"] == tokens[:NEW_TOKENS]
        assert (recorder.logits_of(p).cpu() - logits[:NEW_TOKENS]).abs().max().item() < 1e-4
    engine.runner.sampler = recorder.sampler
    before = (runner.prefill_graphs.replays, runner.mixed_graphs.replays)
    _check(llm, prompts, refs)  # the same engine, every graph captured now
    assert runner.prefill_graphs.replays + runner.mixed_graphs.replays > sum(before)


@pytest.mark.gpus(1)
def test_an_idle_served_engine_captures_the_rest_in_the_background(checkpoints):
    folder = checkpoints.get("LlamaForCausalLM", num_hidden_layers=2)
    prompts = random_prompts(LENGTHS[:4], vocab_size_of(folder), seed=13)
    refs = hf_greedy(folder, prompts, NEW_TOKENS)
    llm = LLM(str(folder), **OPTIONS)

    async def serve() -> None:
        loop = AsyncEngine(llm.engine, lambda outputs, load: None)
        task = asyncio.create_task(loop.run())
        deadline = time.monotonic() + 120
        while (await loop.call(lambda e: e.load().graphs_pending)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        loop.close()
        await task

    asyncio.run(serve())
    assert llm.engine.load().graphs_pending == 0
    _check(llm, prompts, refs)
    assert llm.engine.runner.mixed_graphs.replays > 0  # the prompts' 71 tokens: a mixed-step graph made meanwhile
