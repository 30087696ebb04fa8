"""Steps with prompt chunks through MixedGraphs (engine.runner.mixed_graphs): the pieces between attention calls
over padded static buffers give transformers' greedy tokens and logits, whether the step is prefill-only or mixed
with decodes. On the CPU the pieces run eagerly in Triton's interpreter (a CUDA graph replays exactly them); on a
GPU they are captured and replayed for real."""

import pytest
import torch

from engine import LLM
from engine.runner.mixed_graphs import MixedGraphs, mixed_buckets
from tests.engine_helpers import assert_greedy_matches, hf_greedy, random_prompts
from tests.test_model_exactness import vocab_size_of

pytestmark = pytest.mark.gpu  # runs its GPU path on a CUDA device when there is one (tests/conftest.py)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEW_TOKENS = 4


def test_buckets_cover_every_step_up_to_the_bound():
    assert mixed_buckets(2048) == [64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert mixed_buckets(100) == [64, 100] and mixed_buckets(600) == [64, 128, 256, 512, 600]
    assert mixed_buckets(0) == []


def test_mixed_and_prefill_steps_through_the_pieces_match_transformers(checkpoints):
    """Prompts of 120 tokens in all at a 64-token budget: the first step is prefill-only (64 tokens: bucket 64),
    the next ones carry the rest of the prompts beside the decodes of the first ones (mixed, under 64 tokens: the
    bucket padded). The static buffers start out stale (slots that would store into real blocks, positions,
    residuals): padding must overwrite what it relies on."""
    folder = checkpoints.get("LlamaForCausalLM", num_hidden_layers=2)
    prompts = random_prompts((30, 25, 20, 33, 12), vocab_size_of(folder), seed=9)
    refs = hf_greedy(folder, prompts, NEW_TOKENS)
    llm = LLM(str(folder), device=DEVICE, kernels="triton", prefill_graph_tokens=0, max_num_batched_tokens=64,
              block_size=16)
    engine = llm.engine
    if DEVICE == "cpu":  # the pieces, eagerly (no CUDA graph to capture)
        engine.runner.mixed_graphs = MixedGraphs(engine.model, engine.kv_cache, 64, capture=False)
    graphs = engine.runner.mixed_graphs
    graphs.slots.copy_(torch.arange(graphs.slots.shape[0]))
    graphs.positions.copy_(torch.arange(graphs.positions.shape[0]))
    graphs.residual.normal_()
    graphs.o.normal_()
    assert_greedy_matches(llm, prompts, refs, NEW_TOKENS, 1e-4)
    assert graphs.replays >= 2, "the prompt steps were meant to run through the pieces"
    counts = engine.check_integrity()
    assert counts["in_use"] == 0 and counts["pinned"] == 0
