"""The attention-launch benchmarks' arguments do what they say. benchmarks/attention_stages.py: with its patch in
place, the launch the decode attention picks for one cache (and every launch warm-up compiles for it) runs on the
stage count asked for, the other cache's launches stay as they were, and a bad --stages is refused by name;
benchmarks/fp8_gpu.py attention --launches: parsed into launches, or refused by name."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from benchmarks.attention_bench import parse_launches
from benchmarks.attention_stages import parse_stages, with_stages
from engine.kernels import decode_attention, decode_launch
from engine.kernels.decode_launch import AttentionLaunch


def test_the_patch_reaches_the_kernels_pick_and_warm_up_for_one_cache_only():
    before = {fp8: decode_launch.launch_choices(torch.bfloat16, 128, fp8) for fp8 in (False, True)}
    changed = with_stages(decode_launch.launch_config, "fp8", 7)
    with mock.patch("engine.kernels.decode_launch.launch_config", changed), \
            mock.patch("engine.kernels.decode_attention.launch_config", changed):
        picked = decode_attention.launch_config(torch.bfloat16, 128, True, 512)
        assert picked.num_stages == 7
        assert picked._replace(num_stages=0) == decode_launch.launch_config(torch.bfloat16, 128, True, 512)._replace(
            num_stages=0)
        fp8_choices = decode_launch.launch_choices(torch.bfloat16, 128, True)
        assert fp8_choices and all(launch.num_stages == 7 for launch in fp8_choices)
        assert decode_launch.launch_choices(torch.bfloat16, 128, False) == before[False]
    assert decode_launch.launch_choices(torch.bfloat16, 128, True) == before[True]  # undone on leaving


@pytest.mark.parametrize("text", ["fp9:5", "fp8:0", "fp8", "fp8:x", "bf16:5,fp8:"])
def test_a_bad_stages_argument_is_refused_by_name(text):
    with pytest.raises(SystemExit, match="--stages"):
        parse_stages(text)
    assert parse_stages("fp8:5,bf16:4") == {"fp8": 5, "bf16": 4}


@pytest.mark.parametrize("text", ["fp9:32x1x4", "fp8:32x1", "fp8:", "fp8:32x0x4", "fp8:32x1x4,",
                                  "fp8:32x1x4;fp8:32x1x5", "fp8:32x1x4;"])
def test_attention_launches_are_parsed_or_refused_by_name(text):
    with pytest.raises(SystemExit, match="--launches"):
        parse_launches(text)
    assert parse_launches("bf16:64x4x5,32x2x3") == {"bf16": (AttentionLaunch(64, 4, 5), AttentionLaunch(32, 2, 3))}
    assert parse_launches("fp8:32x1x5;bf16:64x4x4") == {"fp8": (AttentionLaunch(32, 1, 5),),
                                                        "bf16": (AttentionLaunch(64, 4, 4),)}
