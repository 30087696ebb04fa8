"""Prefill-only steps through PrefillGraphs' padded static buffers (engine.runner.prefill_graphs) give
transformers' greedy tokens and logits: padding tokens store nothing, padding sequences attend to nothing, and
chunks after a cached prefix read it. On the CPU the padded forward runs eagerly in Triton's interpreter (a CUDA
graph replays exactly that forward); on a GPU the graphs are captured and replayed for real."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runner.prefill_graphs import PrefillBuckets, PrefillGraphs
from engine.runner.rank_setup import blocks_for
from tests.engine_helpers import LogitsRecorder, hf_greedy, random_prompts
from tests.test_model_exactness import vocab_size_of

# A padded step's padding tokens belong to no sequence: attention leaves their output rows unwritten (whatever the
# buffer held), and numpy may overflow on them in the interpreter's kernels (squares, sums, inf * 0). Every row's
# math is its own (activation quantization too is per row), so the real rows, which these tests check, are untouched.
pytestmark = [pytest.mark.gpu,  # runs its GPU path on a CUDA device when there is one (tests/conftest.py)
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                         "ignore:invalid value encountered:RuntimeWarning")]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = (5, 17, 20, 3, 11)
NEW_TOKENS = 4


def test_buckets_cover_every_prefill_only_step_up_to_the_bound():
    buckets = PrefillBuckets(100, 8)
    assert buckets.tokens == [16, 32, 64, 100]
    assert buckets.seqs(16) == [1, 2, 4, 8] and buckets.seqs(100) == [1, 2, 4, 8]
    assert PrefillBuckets(512, 256).seqs(32) == [1, 2, 4, 8, 16]
    for tokens in range(2, 101):
        for seqs in range(1, min(tokens // 2, 8) + 1):  # every prefill chunk has at least 2 tokens
            t, n = buckets.bucket_for(tokens, seqs)
            assert t >= tokens and n >= seqs and (t, n) in buckets.all()
    assert buckets.bucket_for(101, 1) is None
    assert PrefillBuckets(0, 8).all() == [] and PrefillBuckets(0, 8).bucket_for(2, 1) is None


def _llm(folder, graphs_tokens: int, **kw) -> LLM:
    llm = LLM(str(folder), device=DEVICE, kernels="triton", prefill_graph_tokens=graphs_tokens, **kw)
    engine = llm.engine
    if DEVICE == "cpu":  # the padded forward, eagerly (no CUDA graph to capture)
        width = blocks_for(engine.config.max_model_len, engine.config.block_size)
        engine.runner.prefill_graphs = PrefillGraphs(engine.model, engine.kv_cache, graphs_tokens,
                                                     engine.config.max_num_seqs, width, capture=False)
    graphs = engine.runner.prefill_graphs
    # stale entries of an earlier, larger step: padding must overwrite each one it relies on (slots that store into
    # real blocks, sequences with tokens and context)
    graphs.slots.copy_(torch.arange(graphs.slots.shape[0]))
    graphs.query_start.copy_(3 * torch.arange(graphs.query_start.shape[0]))
    graphs.context_lens.fill_(40)
    return llm


def test_padded_prefill_steps_match_transformers(checkpoints):
    """First pass, all prompts at once: one step of 56 tokens in 5 chunks, replayed as bucket (64, 8): padding of
    both kinds (it fails if either padding write is left out). Second pass, one prompt at a time, first token only:
    each prompt's step is prefill-only and starts after its cached prefix (what a later chunk of a chunked prompt
    sees too)."""
    budget, block = 64, 16
    folder = checkpoints.get("LlamaForCausalLM", num_hidden_layers=1)
    prompts = random_prompts(LENGTHS, vocab_size_of(folder), seed=5)
    refs = hf_greedy(folder, prompts, NEW_TOKENS)
    llm = _llm(folder, budget, max_num_batched_tokens=budget, block_size=block)
    graphs, scheduler = llm.engine.runner.prefill_graphs, llm.engine.scheduler

    def check(indices: list[int], new_tokens: int) -> None:
        recorder = LogitsRecorder(llm.engine)
        params = [SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True) for _ in indices]
        outs = llm.generate([prompts[i] for i in indices], params)
        for out, p, i in zip(outs, params, indices, strict=True):
            assert out.token_ids == refs[i][0][:new_tokens]
            diff = (recorder.logits_of(p).cpu() - refs[i][1][:new_tokens]).abs().max().item()
            assert diff < 1e-4, f"max abs logits difference {diff}"
        llm.engine.runner.sampler = recorder.sampler

    check(list(range(len(prompts))), NEW_TOKENS)
    assert graphs.replays >= 1, "the first step was meant to replay a prefill graph"
    replays, hits = graphs.replays, scheduler.num_prefix_hit_tokens
    for i in range(len(prompts)):
        check([i], 1)
    assert graphs.replays - replays >= 3 and scheduler.num_prefix_hit_tokens > hits
    counts = llm.engine.check_integrity()
    assert counts["in_use"] == 0 and counts["pinned"] == 0


def test_mixed_steps_and_long_steps_stay_eager(checkpoints):
    folder = checkpoints.get("LlamaForCausalLM", num_hidden_layers=1)
    llm = _llm(folder, 16, max_num_batched_tokens=64)
    graphs = llm.engine.runner.prefill_graphs
    llm.generate(random_prompts((40,), vocab_size_of(folder), seed=6), SamplingParams(max_tokens=2))
    assert graphs.replays == 0  # 40 tokens: above the 16-token bound
    llm.generate(random_prompts((9,), vocab_size_of(folder), seed=7), SamplingParams(max_tokens=2))
    assert graphs.replays == 1
