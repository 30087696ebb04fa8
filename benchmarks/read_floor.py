"""The floor a served decode step is compared with: the bytes one step must read (every weight but the gathered
embedding table, each in its own dtype, plus the running requests' KV) over the device's copy rate, measured here.

benchmarks/serve_load.py `smoke --floor` runs this in a process of its own before the server starts (its CUDA
context and 4 GiB of copy buffers are gone before the server's workers size their KV caches):

    python benchmarks/read_floor.py /tmp/l70b-fp8 --kv-tokens 4352 --kv-cache-dtype auto

prints one JSON line: weight_bytes, kv_bytes, copy_gbs, floor_ms. The weight bytes come from the engine's own model
built on the meta device (FP8 linears swapped in as the engine swaps them), so they follow the checkpoint's
quantization exactly as the engine loads it; no weights are read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.model.decoder import CausalLM  # noqa: E402
from engine.model.fp8_linear import swap_in_fp8  # noqa: E402
from engine.model.model_config import ModelConfig  # noqa: E402

EMBEDDING = "model.embed_tokens.weight"


def weight_read_bytes(folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of parameters a decode step reads at TP=1: all but the embedding table (whose rows are gathered), which
    counts when it is tied to the LM head."""
    mc = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = CausalLM(mc, 16, None).to(dtype)
        if mc.fp8 is not None:
            swap_in_fp8(model, mc.fp8, dtype)
    nbytes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    return sum(nbytes.values()) - (0 if mc.tie_word_embeddings else nbytes[EMBEDDING])


def kv_token_bytes(folder: str | Path, kv_cache_dtype: str) -> int:
    """Bytes of K and V one token holds over all layers (an fp8 cache's per-block scales left out: < 0.1%)."""
    mc = ModelConfig.from_folder(folder)
    element = 1 if kv_cache_dtype == "fp8" else 2
    return mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * element


def floor(folder: str | Path, kv_tokens: int, kv_cache_dtype: str) -> dict:
    weights = weight_read_bytes(folder)
    kv = kv_tokens * kv_token_bytes(folder, kv_cache_dtype)
    from benchmarks.engine_bench_gpu import copy_bandwidth  # the kernel benchmarks' floor rate, same measure
    rate = copy_bandwidth()
    return {"weight_bytes": weights, "kv_bytes": kv, "copy_gbs": round(rate / 1e9, 1),
            "floor_ms": round((weights + kv) / rate * 1e3, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="checkpoint folder (config.json; weights need not be there)")
    p.add_argument("--kv-tokens", type=int, default=0, help="tokens of KV a step reads (the batch's contexts)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("read_floor.py measures the copy rate of a CUDA device: none is visible")
    print(json.dumps(floor(args.model, args.kv_tokens, args.kv_cache_dtype)), flush=True)


if __name__ == "__main__":
    main()
