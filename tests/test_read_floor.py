"""benchmarks/read_floor.py's byte count on the CPU: the bytes a decode step reads are the checkpoint's tensors bar
the gathered embedding table (bfloat16, and per-channel FP8 at about half), and a token's KV follows the cache dtype.
The copy rate needs CUDA (benchmarks/gpu_run.sh fp8_70b measures it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from benchmarks.make_random_checkpoint import quantize_folder
from benchmarks.read_floor import EMBEDDING, kv_token_bytes, weight_read_bytes


def stored_bytes(folder: Path, skip: str | None, only: str = "") -> int:
    """Bytes of every tensor the checkpoint stores whose name holds `only`, but `skip`."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if name != skip and only in name:
                    t = f.get_tensor(name)
                    total += t.numel() * t.element_size()
    return total


@pytest.fixture(scope="module")
def bf16(checkpoints) -> Path:
    return checkpoints.get("LlamaForCausalLM", dtype="bfloat16")


def test_bf16_step_reads_every_tensor_but_the_embedding(bf16):
    assert weight_read_bytes(bf16) == stored_bytes(bf16, EMBEDDING)


def test_fp8_step_reads_its_e4m3_weights_and_scales(bf16, tmp_path):
    fp8 = quantize_folder(bf16, tmp_path / "fp8", "channel")
    got = weight_read_bytes(fp8)
    assert got == stored_bytes(fp8, EMBEDDING)
    linears = stored_bytes(bf16, None, only="_proj.weight")  # the LM head and the norms stay bfloat16
    scales = stored_bytes(fp8, None, only="scale")
    assert got == weight_read_bytes(bf16) - linears // 2 + scales


def test_kv_token_bytes_follow_the_cache_dtype(bf16):
    cfg = json.loads((bf16 / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_layer = 2 * cfg["num_key_value_heads"] * head_dim  # K and V
    assert kv_token_bytes(bf16, "auto") == cfg["num_hidden_layers"] * per_layer * 2
    assert kv_token_bytes(bf16, "fp8") == cfg["num_hidden_layers"] * per_layer


def test_smoke_floor_without_cuda_is_a_clear_error_and_ratios_divide_by_it(bf16):
    from argparse import Namespace

    from benchmarks.serve_load import against_floor, read_floor
    args = Namespace(requests=4, prompt_len=64, max_tokens=8)
    with pytest.raises(SystemExit, match="read_floor.py failed: .*no.*CUDA|none is visible"):
        read_floor({"model": str(bf16)}, args)
    got = against_floor({"tpot_ms_p50": 22.0, "chunk_gap_ms_p50": 20.0}, {"floor_ms": 16.0})
    assert got == {"tpot_x_floor": 1.375, "chunk_gap_x_floor": 1.25}
