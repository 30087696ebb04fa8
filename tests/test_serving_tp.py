"""Serving a tensor-parallel worker (collocated, TP=2 on gloo): the same outputs as the single engine, and a lost
rank replaces the whole worker while its streams migrate and still end exactly."""

import asyncio
import subprocess
import sys

import httpx
import pytest

from coordinator.config.serve_config import load_serve_config
from engine import SamplingParams
from engine.config_error import ConfigError
from tests.engine_helpers import random_prompts
from tests.server_process import (
    OPERATOR,
    admin_integrity,
    admin_kill,
    complete,
    running_server,
    streams_with_a_kill,
    tp_followers,
    wait_for_health,
    wait_for_idle_workers,
    worker_pids,
)

TOKENS = 60


@pytest.fixture(scope="module")
def server_tp(llama, tmp_path_factory):
    config = {"model": str(llama), "mode": "collocated",
              "decode": {"num_cpus": 1, "kv_cache_memory_bytes": 64 << 20, "tensor_parallel_size": 2},
              "recovery": {"backoff_initial_s": 0.1}, "server": {"admin_api": True}}
    with running_server(tmp_path_factory.mktemp("server_tp"), config) as server:
        yield server


def _bodies(llama, n: int, seed: int) -> list[dict]:
    prompts = random_prompts([6 + 7 * i for i in range(n)], 2000, seed=seed)
    return [{"model": str(llama), "prompt": p, "max_tokens": TOKENS, "ignore_eos": True, "stream": i % 2 == 0,
             **({"temperature": 0} if i % 2 else {"temperature": 0.8, "seed": i})} for i, p in enumerate(prompts)]


def _expected(reference, bodies: list[dict]) -> list[str]:
    return [reference.generate([b["prompt"]], SamplingParams(temperature=b["temperature"], seed=b.get("seed"),
                                                             max_tokens=TOKENS, ignore_eos=True))[0].text
            for b in bodies]


def test_a_tp2_worker_serves_the_single_engine_outputs(server_tp, reference, llama):
    bodies = _bodies(llama, 4, seed=41)

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[complete(client, server_tp.url, b) for b in bodies])
    assert [r["text"] for r in asyncio.run(run())] == _expected(reference, bodies)
    wait_for_idle_workers(server_tp.url)


def test_a_lost_rank_replaces_the_worker_and_its_streams_finish_exactly(server_tp, reference, llama):
    [actor] = worker_pids(server_tp, "collocated")
    [follower] = tp_followers(actor)
    bodies = [{**b, "stream": True} for b in _bodies(llama, 4, seed=42)]
    expected = _expected(reference, bodies)

    bad = httpx.post(f"{server_tp.url}/admin/workers/decode-0/kill?rank=2", headers=OPERATOR, timeout=30)
    assert bad.status_code == 400 and "rank" in bad.json()["error"]["message"], bad.text  # TP=2: rank 1 only

    async def kill() -> None:
        await admin_kill(server_tp.url, "decode-0", rank=1)  # SIGKILL of rank 1 of the worker's group
    results = streams_with_a_kill(server_tp.url, bodies, kill, timeout_s=400)
    for got, want in zip(results, expected, strict=True):
        assert (got["text"], got["completion_tokens"]) == (want, TOKENS)
    wait_for_health(server_tp.url, 200)
    assert worker_pids(server_tp, "collocated") != [actor]  # the whole group was replaced
    states = httpx.get(f"{server_tp.url}/health", timeout=10).json()
    assert states["status"] == "ok", states
    wait_for_idle_workers(server_tp.url)
    assert admin_integrity(server_tp.url)["ok"]


def test_tp_on_fractions_of_a_gpu_is_refused_with_the_key_named(tmp_path):
    path = tmp_path / "tp.yaml"
    path.write_text("mode: collocated\ndecode:\n  tensor_parallel_size: 2\n  num_gpus: 0.5\n")
    with pytest.raises(ConfigError, match="whole GPUs"):
        load_serve_config(path)


def test_a_tp_size_the_model_cannot_split_is_refused_before_any_worker_starts(llama, tmp_path):
    path = tmp_path / "tp3.yaml"
    path.write_text(f"model: {llama}\nprefill:\n  tensor_parallel_size: 3\n")
    result = subprocess.run([sys.executable, "-m", "coordinator.cli", "serve", str(path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "prefill.tensor_parallel_size 3 must divide the model's 4 attention heads" in result.stderr, result.stderr
