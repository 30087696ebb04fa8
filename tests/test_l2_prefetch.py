"""engine.kernels.l2_prefetch's launch rule: how many weight tiles each program of an FP8 GEMM asks into L2 before its
PDL wait. The instruction itself runs only under PDL on a Hopper GPU (tests/test_pdl.py's graph of PDL launches
checks its bits there; tests/hopper_compile.py that it is built before the wait); this is the host side's rule."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import l2_prefetch
from engine.kernels.l2_prefetch import prefetch_tiles

FP8 = torch.float8_e4m3fn


def weight(n: int, k: int) -> torch.Tensor:
    return torch.zeros(n, k, dtype=FP8)


def test_nothing_without_a_budget_or_without_pdl(monkeypatch):
    w = weight(128, 4096)
    monkeypatch.setattr(l2_prefetch, "BUDGET_BYTES", 0)
    assert prefetch_tiles(w, (2, 1, 1), 64, 256, 4096, True) == 0
    monkeypatch.setattr(l2_prefetch, "BUDGET_BYTES", 1 << 30)
    assert prefetch_tiles(w, (2, 1, 1), 64, 256, 4096, False) == 0


def test_the_budget_is_shared_by_every_program_and_a_split_is_the_most(monkeypatch):
    w = weight(4096, 4096)
    monkeypatch.setattr(l2_prefetch, "BUDGET_BYTES", 16 << 20)
    # 64 tiles of 64 rows x 2 splits: 128 programs of 16 KiB tiles; 16 MiB / (128 x 16 KiB) = 8, a split's 8 tiles
    assert prefetch_tiles(w, (64, 1, 2), 64, 256, 2048, True) == 8
    monkeypatch.setattr(l2_prefetch, "BUDGET_BYTES", 4 << 20)
    assert prefetch_tiles(w, (64, 1, 2), 64, 256, 2048, True) == 2
    monkeypatch.setattr(l2_prefetch, "BUDGET_BYTES", 1 << 30)
    assert prefetch_tiles(w, (64, 1, 2), 64, 256, 2048, True) == 8  # never past the split's own tiles
    monkeypatch.setattr(l2_prefetch, "BUDGET_BYTES", 1 << 20)
    assert prefetch_tiles(w, (64, 1, 2), 64, 256, 2048, True) == 0  # less than a tile a program: none


@pytest.mark.parametrize("shape,view", [((64, 4104), None), ((64, 4096), (slice(None), slice(8, 4088))),
                                        ((64, 4097), (slice(None), slice(0, 4096)))])
def test_rows_the_instruction_cannot_take_get_none(monkeypatch, shape, view):
    """cp.async.bulk.prefetch.L2 takes 16-byte aligned addresses and sizes: a K that is not a multiple of 16, a
    row stride that is not, or a base that is not, and the launch asks for nothing."""
    monkeypatch.setattr(l2_prefetch, "BUDGET_BYTES", 1 << 30)
    w = weight(*shape)
    if view is not None:
        w = w[view]
    assert prefetch_tiles(w, (1, 1, 1), 64, 256, w.shape[1], True) == 0
    assert prefetch_tiles(weight(64, 4096), (1, 1, 1), 64, 256, 4096, True) == 16
