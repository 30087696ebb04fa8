"""The engine's kernel path (fused projections + Triton kernels; CUDA graphs on a GPU) gives transformers' greedy
tokens and logits. Without a GPU the kernels run in Triton's interpreter on the CPU; on a GPU for real."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine_helpers import LogitsRecorder, assert_greedy_matches, hf_greedy, random_prompts
from tests.test_model_exactness import vocab_size_of

pytestmark = pytest.mark.gpu  # runs its GPU path on a CUDA device when there is one (tests/conftest.py)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEW_TOKENS = 10
LENGTHS = (5, 17, 40)


def check(llm: LLM, prompts, refs, tolerance: float) -> None:
    assert_greedy_matches(llm, prompts, refs, NEW_TOKENS, tolerance)
    counts = llm.engine.check_integrity()
    assert counts["in_use"] == 0 and counts["pinned"] == 0


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM"])
def test_kernel_path_matches_transformers(checkpoints, arch):
    folder = checkpoints.get(arch)
    prompts = random_prompts(LENGTHS, vocab_size_of(folder), seed=3)
    refs = hf_greedy(folder, prompts, NEW_TOKENS)
    llm = LLM(str(folder), device=DEVICE, kernels="triton", enable_prefix_caching=False)
    assert llm.engine.model.kernels_enabled
    check(llm, prompts, refs, 1e-4)
    if DEVICE == "cuda":
        assert llm.engine.runner.graphs.replays > 0, "decode steps were meant to replay CUDA graphs"


def test_kernel_path_chunked_prefill_and_prefix_hits(checkpoints):
    """8-token chunks put decode rows and prefill chunks (with a cached prefix) in one step; the second pass
    reads every full prompt block from the prefix cache. One layer: the interpreter runs every kernel program in
    Python, and chunking and prefix reuse are the same in every layer."""
    folder = checkpoints.get("LlamaForCausalLM", num_hidden_layers=1)
    prompts = random_prompts(LENGTHS, vocab_size_of(folder), seed=4)
    refs = hf_greedy(folder, prompts, NEW_TOKENS)
    llm = LLM(str(folder), device=DEVICE, kernels="triton", max_num_batched_tokens=8, block_size=8)
    check(llm, prompts, refs, 1e-4)
    before = llm.engine.scheduler.num_prefix_hit_tokens
    check(llm, prompts, refs, 1e-4)
    assert llm.engine.scheduler.num_prefix_hit_tokens - before == sum((n - 1) // 8 * 8 for n in LENGTHS)


def test_kernel_path_bfloat16_follows_transformers(checkpoints):
    folder = checkpoints.get("LlamaForCausalLM")
    prompts = random_prompts((9, 23), vocab_size_of(folder), seed=1)
    refs = hf_greedy(folder, prompts, 4, dtype=torch.bfloat16)
    llm = LLM(str(folder), device=DEVICE, kernels="triton", dtype="bfloat16")
    recorder = LogitsRecorder(llm.engine)
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True) for _ in prompts]
    outs = llm.generate(prompts, params)
    for out, p, (ref_tokens, ref_logits) in zip(outs, params, refs, strict=True):
        # the first step sees identical inputs; later steps may drift by a rounding, so compare the first token
        assert out.token_ids[0] == ref_tokens[0]
        first = recorder.logits_of(p)[0].cpu()
        assert (first - ref_logits[0]).abs().max().item() < 0.05 * ref_logits[0].abs().max()
