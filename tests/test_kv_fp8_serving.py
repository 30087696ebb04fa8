"""kv_cache_dtype in serving: a 1P+1D server with an fp8 cache on both pools moves half the bytes of the same
server with a bfloat16 cache (the transfer layer's byte counter, /metrics), pools that disagree are refused at
load naming the setting, and two caches that disagree refuse to connect naming it too."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml

from coordinator.backend.worker_events import STATS_PERIOD_S
from coordinator.config.serve_config import load_serve_config
from engine.config_error import ConfigError
from engine.kv_heads import KVHeadRange
from engine.kv_layout import KVCacheSpec
from engine.kv_quant import KVScales
from kvtransfer.errors import IncompatibleLayout
from kvtransfer.metadata import AgentMetadata, CacheInfo, check_compatible
from tests.server_process import HALF_CPU, metric_values, running_server

PROMPTS = ["The sea at night " * 12, "A long prompt about caches and bytes " * 9]


def _bytes_moved(tmp_path: Path, kv_cache_dtype: str) -> tuple[float, list[str]]:
    """(transfer bytes after serving PROMPTS, the completions' texts) on a fresh bfloat16 1P+1D server."""
    config = {"model": "tiny", "dtype": "bfloat16", "kv_cache_dtype": kv_cache_dtype, "prefill": HALF_CPU,
              "decode": HALF_CPU}
    with running_server(tmp_path / kv_cache_dtype, config) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        before = sum(metric_values(server.url, "pdserve_transfer_bytes_total").values())  # warm-up's, if any
        texts = []
        for prompt in PROMPTS:
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                     "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        moved = _settled_bytes(server.url) - before
    return moved, texts


def _settled_bytes(url: str) -> float:
    """The byte counter once the coordinator's stats loop (every STATS_PERIOD_S) has gathered every transfer:
    the first value above 0 that the next refreshes leave unchanged."""
    last, same = None, 0
    for _ in range(120):
        value = sum(metric_values(url, "pdserve_transfer_bytes_total").values())
        same = same + 1 if value == last and value > 0 else 0
        if same == 2:
            return value
        last = value
        time.sleep(STATS_PERIOD_S)
    raise AssertionError(f"the transfer byte counter did not settle (last {last})")


def test_fp8_pools_move_half_the_bytes(tmp_path):
    bf16, bf16_texts = _bytes_moved(tmp_path, "auto")
    fp8, fp8_texts = _bytes_moved(tmp_path, "fp8")
    print(f"\nKV bytes moved for {len(PROMPTS)} prompts: bfloat16 {bf16:.0f}, fp8 {fp8:.0f}")
    assert bf16 > 0 and fp8 * 2 == bf16
    assert all(len(t) > 0 for t in fp8_texts + bf16_texts)


def _write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_pools_that_disagree_are_refused_at_load(tmp_path):
    path = _write(tmp_path, {"model": "tiny", "kv_cache_dtype": "fp8", "decode": {"kv_cache_dtype": "auto"}})
    with pytest.raises(ConfigError, match=r"prefill.kv_cache_dtype 'fp8' and decode.kv_cache_dtype 'auto' disagree"):
        load_serve_config(path)
    same = load_serve_config(_write(tmp_path, {"model": "tiny", "prefill": {"kv_cache_dtype": "fp8"},
                                               "decode": {"kv_cache_dtype": "fp8_e4m3"}}))
    assert same.engine_config(same.prefill).kv_cache_dtype == "fp8"
    assert same.engine_config(same.decode).kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        load_serve_config(_write(tmp_path, {"model": "tiny", "kv_cache_dtype": "int4"}))


def _agent(spec: KVCacheSpec) -> AgentMetadata:
    return AgentMetadata("d0", "127.0.0.1", 1, "h", 1, CacheInfo(spec, 8, "cpu"))


def test_caches_that_disagree_refuse_to_connect_naming_the_setting():
    base = dict(model_id="m", num_layers=2, num_kv_heads=2, head_dim=32, block_size=16)
    bf16 = KVCacheSpec(dtype="bfloat16", **base)
    fp8 = KVCacheSpec(dtype="float8_e4m3fn", kv_scales=KVScales.ones(2).digest(), **base)
    with pytest.raises(IncompatibleLayout, match="kv_cache_dtype"):
        check_compatible(CacheInfo(bf16, 8, "cpu"), _agent(fp8), "p0")
    scaled = KVCacheSpec(dtype="float8_e4m3fn", kv_scales=KVScales((0.5, 1.0), (1.0, 1.0)).digest(), **base)
    with pytest.raises(IncompatibleLayout, match="k_scale/v_scale"):
        check_compatible(CacheInfo(fp8, 8, "cpu"), _agent(scaled), "p0")
    check_compatible(CacheInfo(fp8, 8, "cpu", heads=KVHeadRange(0, 2, 2)), _agent(fp8), "p0")  # agreeing: fine
    assert fp8.block_bytes * 2 == bf16.block_bytes
