"""The engine on a CUDA device (torch path) gives the CPU engine's tokens. Runs where CUDA exists (the lent GPUs)."""

import pytest

from engine import LLM, SamplingParams
from tests.engine_helpers import LogitsRecorder, random_prompts

pytestmark = pytest.mark.gpus(1)


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


def test_cuda_graph_decode_equals_eager_at_long_contexts(checkpoints):
    """Decode through CUDA graphs (static buffers, padded tables, bucketed batch) equals eager kernel decode and
    the torch path, with contexts of hundreds of tokens spread over many scattered blocks."""
    folder = str(checkpoints.get("LlamaForCausalLM"))
    prompts = random_prompts(tuple(range(300, 460, 13)), 2000, seed=7)  # 13 prompts: bucket 16, 3 padding rows
    runs = {}
    variants = {"graphs": {}, "stepwise": {"async_scheduling": False}, "eager": {"cuda_graphs": False},
                "torch": {"kernels": "torch"}}
    for name, kw in variants.items():
        llm = LLM(folder, device="cuda", num_kv_blocks=512, **kw)
        recorder = LogitsRecorder(llm.engine)
        params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in prompts]
        outs = llm.generate(prompts, params)
        runs[name] = ([o.token_ids for o in outs], [recorder.logits_of(p).cpu() for p in params])
        if name == "graphs":
            assert llm.engine.runner.graphs.replays >= 11
    assert runs["graphs"][0] == runs["stepwise"][0] == runs["eager"][0] == runs["torch"][0]
    for other in ("stepwise", "eager", "torch"):
        diff = max((a - b).abs().max().item() for a, b in zip(runs["graphs"][1], runs[other][1], strict=True))
        assert diff < 1e-3, f"graphs vs {other}: max abs logits difference {diff}"


@pytest.mark.parametrize("num_kv_blocks", [512, 7])
def test_cuda_overlapped_decode_equals_step_by_step_with_joins_stops_aborts(checkpoints, num_kv_blocks):
    """The CPU test's scenario (tests/test_async_scheduling.py) through CUDA graphs: input ids gathered on the
    device from the previous step's samples, rows ending or aborted while their next step is queued."""
    from tests.test_async_scheduling import VOCAB, _drive, _params

    folder = str(checkpoints.get("LlamaForCausalLM"))
    prompts = random_prompts((9, 33, 17, 40, 5, 21), VOCAB, seed=8)
    probe = LLM(folder, device="cuda", num_kv_blocks=512).generate(
        [prompts[2]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    params = _params(probe[0].token_ids[6])
    results = {}
    for overlap in (False, True):
        llm = LLM(folder, device="cuda", async_scheduling=overlap, num_kv_blocks=num_kv_blocks, max_num_seqs=8)
        results[overlap], overlapped = _drive(llm, prompts, params)
        assert (overlapped > 20) == overlap and llm.engine.runner.graphs.replays > 20
    assert results[True] == results[False]
