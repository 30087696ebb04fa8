"""What a worker's start imports: nothing it does not use. A `pdserve serve`'s first workers wait for their process's
imports (pool_worker.preload, or pool_worker.preload_engine for a collocated server), and a start pays any import the
engine makes on its way. torch imported sympy (its symbolic shapes) when the engine allocated the weights of its
meta-device model with Module.to_empty: 2.2 s of an H200 host's 7.4-8.9 s preload (engine.runner.rank_setup._allocate
avoids it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SERVE_AND_REPORT = """
import json, sys
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], device=sys.argv[2], kv_cache_memory_bytes=256 << 20)
out = llm.generate([[5, 6, 7, 8]], [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)])
print(json.dumps({"tokens": out[0].token_ids, "sympy": "sympy" in sys.modules}))
"""


def _run(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


REPORT_MODULES = ("import json, sys; import {module}; print(json.dumps({{name: name in sys.modules for name in "
                  "('sympy', 'ucxx', 'torch', 'engine.llm_engine', 'pool_worker.worker')}}))")


def test_the_preload_imports_no_sympy():
    got = _run(REPORT_MODULES.format(module="pool_worker.preload"))
    assert not got["sympy"] and got["ucxx"] and got["engine.llm_engine"] and got["pool_worker.worker"]


def test_a_collocated_servers_preload_leaves_the_transfer_agents_out():
    """Its workers run no KV agent: their processes started ahead import the engine and the worker, not ucxx."""
    got = _run(REPORT_MODULES.format(module="pool_worker.preload_engine"))
    assert got["torch"] and got["engine.llm_engine"] and got["pool_worker.worker"]
    assert not got["ucxx"] and not got["sympy"]


COLLOCATED_WORKER = """
import asyncio, json, sys
import pool_worker.preload_engine
from engine.engine_config import EngineConfig
from pool_worker.worker import Worker

async def main():
    worker = Worker("decode-0", EngineConfig(model="tiny", max_num_seqs=2), None, 1, 5.0, role="collocated")
    info = await worker.start()
    await worker.shutdown()
    return info

info = asyncio.run(main())
print(json.dumps({"blocks": info.num_kv_blocks, "ucxx": "ucxx" in sys.modules,
                  "kvtransfer.agent": "kvtransfer.agent" in sys.modules}))
"""


def test_a_collocated_worker_starts_without_the_transfer_modules():
    """A worker without a KV agent (collocated) starts in a process that preloaded pool_worker.preload_engine and
    imports no transfer agent on its way: neither kvtransfer's agent nor ucxx is in the process after start()."""
    got = _run(COLLOCATED_WORKER)
    assert got["blocks"] > 0 and not got["ucxx"] and not got["kvtransfer.agent"]


@pytest.mark.parametrize("transfers,preload", [(True, "pool_worker.preload"), (False, "pool_worker.preload_engine")])
def test_a_local_ray_preloads_what_its_workers_use(monkeypatch, transfers, preload):
    import ray

    from coordinator.backend import ray_start
    calls = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    ray_start.init_ray(None, "ns", transfers=transfers)
    ray_start.init_ray("auto", "ns", transfers=transfers)  # a cluster's own raylets decide (configs/cluster.yaml)
    assert calls[0]["_system_config"]["preload_python_modules"] == [preload]
    assert calls[1]["_system_config"] is None


def test_an_engine_starts_and_serves_on_the_cpu_without_sympy():
    got = _run(SERVE_AND_REPORT, "tiny", "cpu")
    assert len(got["tokens"]) == 4 and not got["sympy"]


@pytest.mark.gpus(1)
def test_an_engine_starts_and_serves_on_a_gpu_without_sympy(checkpoints):
    """The CUDA start: weights allocated and drawn, the warm-up (kernels compiled, CUDA graphs captured), a request."""
    llama = checkpoints.get("LlamaForCausalLM", num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=256)
    got = _run(SERVE_AND_REPORT, str(llama), "cuda")
    assert len(got["tokens"]) == 4 and not got["sympy"]


def test_the_supervisor_reaches_ray_without_the_http_server_or_torch(tmp_path):
    """`pdserve serve`'s supervisor starts Ray (after which the workers' processes can start) having imported the
    config, the listening socket and Ray, not FastAPI or uvicorn (its coordinator child imports those while the
    workers start) nor torch: read from `python -X importtime`, whose lines precede the "Ray started" log line."""
    import os
    import signal

    config = tmp_path / "serve.yaml"
    config.write_text("model: tiny\nmode: collocated\ndecode: {workers: 1, num_cpus: 0.5}\n"
                      "server: {host: 127.0.0.1, port: 0}\n")
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "coordinator.cli", "serve", str(config)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    before: list[str] = []
    try:
        for line in proc.stderr:
            if "Ray started" in line:
                break
            if line.startswith("import time:"):
                before.append(line.rsplit("|", 1)[-1].strip())
        else:
            pytest.fail(f"pdserve serve exited ({proc.wait()}) before it started Ray")
    finally:  # the supervisor alone: it stops Ray itself (SIGTERM to the group took Ray's GCS from under it)
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    assert "ray" in before and "coordinator.api.listener" in before
    assert not {"fastapi", "uvicorn", "torch"} & set(before)
