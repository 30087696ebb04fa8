"""1 prefill + 1 decode worker on two CUDA devices, KV over cuda_ipc: streams equal the offline engine's greedy
tokens while requests join a running decode batch before their KV copies have ended (decode_pool: the request
starts as soon as the pull is queued; the device runs its first step after the copies). Runs where two GPUs exist
(the lent nvidia-h200-x2: `TESTS=tests/test_serving_cuda.py bash benchmarks/gpu_run.sh tests`)."""

import asyncio

import httpx
import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts
from tests.server_process import complete, running_server, wait_for_idle_workers

pytestmark = pytest.mark.gpus(2)

POOL = {"workers": 1, "num_gpus": 1, "num_cpus": 2, "kv_cache_memory_bytes": 256 << 20}


def test_handed_over_streams_equal_the_offline_engine(checkpoints, tmp_path):
    folder = str(checkpoints.get("LlamaForCausalLM"))
    lengths = [3 + (i * 37) % 300 for i in range(24)]  # several blocks each, some under one
    prompts = random_prompts(lengths, 2000, seed=11)
    max_tokens = [16 + (i * 7) % 40 for i in range(len(prompts))]
    offline = LLM(folder, device="cuda", kv_cache_memory_bytes=256 << 20)
    want = [o.text for o in offline.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens])]
    del offline
    torch.cuda.empty_cache()
    config = {"model": folder, "placement": "pack", "prefill": POOL, "decode": {**POOL, "max_num_seqs": 64},
              "transfer": {"backends": ["cuda_ipc", "ucx"]}}
    with running_server(tmp_path / "server", config) as server:
        async def run() -> list[dict]:
            async with httpx.AsyncClient(timeout=300) as client:
                async def one(i: int) -> dict:
                    await asyncio.sleep(0.02 * i)  # staggered: later requests join a batch already decoding
                    return await complete(client, server.url, {
                        "model": folder, "prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0,
                        "ignore_eos": True, "stream": True})
                return await asyncio.gather(*[one(i) for i in range(len(prompts))])
        got = asyncio.run(run())
        assert [r["completion_tokens"] for r in got] == max_tokens
        assert [r["text"] for r in got] == want
        wait_for_idle_workers(server.url)
