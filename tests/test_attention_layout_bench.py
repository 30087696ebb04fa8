"""benchmarks/attention_layout.py on the CPU: the head-major view holds the same values with one head's tokens
contiguous, every (layout, lazy) variant is there, and the script refuses to run without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.attention_layout import head_major, variants


def test_the_head_major_view_has_the_same_values_with_a_heads_tokens_contiguous():
    layer = torch.randn(5, 2, 16, 8, 128)  # [NB, 2, bs, KVH, D]
    view = head_major(layer)
    assert view.shape == layer.shape and torch.equal(view, layer)
    assert view.stride()[2:] == (128, 16 * 128, 1)  # tokens D apart, heads bs * D apart
    assert layer.stride()[2:] == (8 * 128, 128, 1)


def test_every_layout_and_softmax_is_a_variant():
    views = variants(torch.zeros(3, 2, 16, 8, 128))
    assert sorted(views) == [("head-major", False), ("head-major", True), ("token-major", False),
                             ("token-major", True)]


def test_the_script_refuses_without_a_gpu():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "attention_layout.py"
    run = subprocess.run([sys.executable, str(script), "--cases", "1x64"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 1 and "no CUDA device" in run.stderr, run.stderr[-2000:]
