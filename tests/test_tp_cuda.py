"""Tensor parallelism on two CUDA devices (NCCL): the kernel path at TP=2, with decode steps replayed from CUDA
graphs that capture the all-reduces and overlapped scheduling on, gives TP=1's greedy tokens and eager TP=2's, with
NCCL for every sum (the default) and with the one-shot all-reduce for small ones (last: after a one-shot engine, a
further TP engine in the same process hung, in its set-up or its close; engine.model.symmetric_all_reduce).
Runs where two GPUs exist (the lent nvidia-h200-x2)."""

import time

import pytest

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts

pytestmark = pytest.mark.gpus(2)


def test_tp2_kernels_and_graphs_equal_tp1_and_eager(checkpoints):
    folder = str(checkpoints.get("LlamaForCausalLM"))
    prompts = random_prompts((1, 7, 40, 100), 2000, seed=2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)
    # a fixed KV budget: a share of the free memory would depend on what else holds the GPUs
    kw = dict(device="cuda", max_num_batched_tokens=32, max_num_seqs=8, kv_cache_memory_bytes=256 << 20)
    start = time.monotonic()

    def progress(what: str) -> None:  # shown with -s: on a lent GPU a silent, slow phase looked like a hang
        print(f"[{time.monotonic() - start:7.1f} s] {what}", flush=True)

    one = LLM(folder, **kw)
    progress("TP=1 engine started")
    want = [o.token_ids for o in one.generate(prompts, params)]
    want_seeded = [o.token_ids for o in one.generate(prompts, seeded)]
    del one
    progress("TP=1 reference generated")
    # NCCL (the default) with and without graphs; then small sums by the one-shot kernel, last (a TP engine built
    # after a one-shot one in the same process hung: engine.model.symmetric_all_reduce)
    for graphs, all_reduce in ((True, "nccl"), (False, "nccl"), (True, "auto")):
        llm = LLM(folder, tensor_parallel_size=2, cuda_graphs=graphs, tp_all_reduce=all_reduce, **kw)
        progress(f"TP=2 engine started (graphs={graphs}, all-reduce {all_reduce})")
        try:
            assert llm.engine.uses_kernels
            assert (llm.engine.followers.tp.one_shot is not None) == (all_reduce == "auto")  # NVLink H200s
            assert [o.token_ids for o in llm.generate(prompts, params)] == want
            assert [o.token_ids for o in llm.generate(prompts, seeded)] == want_seeded
            assert (llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays > 0) == graphs
            assert llm.engine.check_integrity()["in_use"] == 0
            progress("TP=2 outputs equal TP=1's")
        finally:
            llm.engine.close()
            progress("TP=2 engine closed")

