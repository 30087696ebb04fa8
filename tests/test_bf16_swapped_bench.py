"""benchmarks/bf16_swapped.py's launches (the FP8 swapped kernel on bf16 operands, unit scales, K split or not)
compute x @ w^T: each configuration gemm_sweep times, under Triton's interpreter on the CPU and compiled on a GPU,
agrees with the float32 product to bf16's rounding and leaves its split semaphores zero, twice in a row."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bf16_swapped import BF16_MM_CONFIGS, bf16_swapped_mm, config_name, swapped_buffers

pytestmark = pytest.mark.gpu  # compiled on a CUDA device when there is one (tests/conftest.py)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K, N = (4096, 4096) if DEVICE == "cuda" else (200, 72)  # the CPU's: two K tiles of 128 and a ragged one, N ragged


@pytest.mark.parametrize("m", [5, 40])
def test_every_swept_bf16_launch_computes_the_product(m):
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(N, K, generator=gen) * 0.05).to(torch.bfloat16).to(DEVICE)
    want = x.float() @ w.float().t()
    for config in BF16_MM_CONFIGS:
        buffers = swapped_buffers(m, N, config, x.device)
        out = torch.empty(m, N, dtype=torch.bfloat16, device=DEVICE)
        for _ in range(2):
            out.zero_()
            bf16_swapped_mm(x, w, out, config, buffers)
            err = ((out.float() - want).abs().max() / want.abs().max()).item()
            assert err < 1e-2, f"{config_name(config, m)}: relative error {err}"
            assert not buffers.sems.any(), config_name(config, m)


def test_names_say_the_split_only_when_there_is_one():
    assert config_name((64, 128, 4, 5, 1), 16) == "bf16_mm_64x16x128w4s5"
    assert config_name((64, 128, 4, 4, 2), 40) == "bf16_mm_64x64x128w4s4k2"
