"""The engine on a CUDA device (torch path) gives the CPU engine's tokens. Runs where CUDA exists (the lent GPUs)."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_greedy_equals_cpu_and_disaggregated_decode_works(checkpoints):
    folder = str(checkpoints.get("LlamaForCausalLM"))
    prompts = random_prompts((7, 40, 100), 2000, seed=2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cpu = LLM(folder).generate(prompts, params)
    gpu_llm = LLM(folder, device="cuda", max_num_batched_tokens=32)
    gpu = gpu_llm.generate(prompts, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)
    assert gpu_llm.generate(prompts, seeded)[0].token_ids == gpu_llm.generate(prompts[:1], seeded)[0].token_ids
    counts = gpu_llm.engine.check_integrity()
    assert counts["in_use"] == 0 and counts["pinned"] == 0
