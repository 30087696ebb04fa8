"""The attention-launch benchmarks' arguments do what they say. benchmarks/attention_stages.py: with its patch in
place, the launch the decode attention picks for one cache (and every launch warm-up compiles for it) runs on the
stage count asked for, the other cache's launches stay as they were, and a bad --stages is refused by name; its
--max-splits patch caps the split count the kernel's default and warm-up see, leaving smaller counts alone, and a
cap the kernel cannot launch is refused; run as a script, each mode reaches its check of the machine;
benchmarks/fp8_gpu.py attention --launches: parsed into launches, or refused by name."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from benchmarks import attention_stages, step_ab
from benchmarks.attention_bench import parse_launches
from benchmarks.attention_stages import parse_split_caps, parse_stages, with_max_splits, with_stages
from engine.kernels import decode_attention, decode_launch
from engine.kernels.decode_launch import AttentionLaunch
from engine.runner import warmup


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
                                  "fp8:32x1x4;fp8:32x1x5", "fp8:32x1x4;", "fp8:32x1x4ss", "fp8:32sx1x4"])
def test_attention_launches_are_parsed_or_refused_by_name(text):
    with pytest.raises(SystemExit, match="--launches"):
        parse_launches(text)
    assert parse_launches("bf16:64x4x5,32x2x3") == {"bf16": (AttentionLaunch(64, 4, 5), AttentionLaunch(32, 2, 3))}
    assert parse_launches("fp8:32x1x5;bf16:64x4x4") == {"fp8": (AttentionLaunch(32, 1, 5),),
                                                        "bf16": (AttentionLaunch(64, 4, 4),)}
    assert parse_launches("fp8:32x1x4s,32x1x4") == {"fp8": (AttentionLaunch(32, 1, 4, swapped=True),
                                                            AttentionLaunch(32, 1, 4))}


def test_the_split_cap_reaches_the_kernels_default_and_warm_up_only_above_the_cap():
    h200 = 132
    one_row = (1, 8, 512, h200)  # batch 1 at 8 KV heads, a graph's table of 512 blocks
    many_rows = (64, 8, 512, h200)
    assert decode_launch.num_splits_for(*one_row) == 64
    small = decode_launch.num_splits_for(*many_rows)
    capped = with_max_splits(decode_launch.num_splits_for, 16)
    with mock.patch("engine.kernels.decode_launch.num_splits_for", capped), \
            mock.patch("engine.runner.warmup.num_splits_for", capped):
        assert decode_launch.num_splits_for(*one_row) == 16
        assert warmup.num_splits_for(*one_row, True) == 16
        assert decode_launch.num_splits_for(*many_rows) == small < 16
        # the kernel's own call (CPU: 4 "SMs" -> a count under the cap, unchanged)
        assert decode_launch.default_num_splits(1, 8, 512, torch.device("cpu")) == 1
    assert decode_launch.num_splits_for(*one_row) == 64  # undone on leaving


def test_split_caps_are_parsed_or_refused_by_value():
    assert parse_split_caps("16,8,4") == (16, 8, 4)
    for text in ("12", "16,", "x", "0", "128"):
        with pytest.raises(argparse.ArgumentTypeError, match="each cap must be one of"):
            parse_split_caps(text)


@pytest.mark.parametrize("mode", [["--max-splits", "16,8"], ["--early-kv", "off"], ["--stages", "fp8:5"],
                                  ["--lazy", "on"]])
def test_each_mode_runs_as_a_script_up_to_its_machine_check(mode, tmp_path):
    """Every mode's function exists by the time the script calls it (a function defined below the __main__ guard
    would raise NameError here) and stops at the same clear refusal where no device is visible (hidden here, so a
    GPU machine checks the same thing instead of running the benchmark)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "attention_stages.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(script), "--bf16", str(tmp_path), "--fp8", str(tmp_path), *mode],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 1 and "no CUDA device" in run.stderr, run.stderr[-2000:]


def test_two_comparisons_in_one_run_are_refused():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "attention_stages.py"
    run = subprocess.run([sys.executable, str(script), "--bf16", "b", "--fp8", "f", "--early-kv", "off",
                          "--max-splits", "16"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "not allowed with argument" in run.stderr, run.stderr[-2000:]


def test_each_variant_engine_is_built_and_timed_inside_its_patches_and_compared(monkeypatch, capsys):
    """The GPU-only pieces (the machine check, the ceilings, an engine's timed cases) replaced by a recorder: each
    variant's engine sees its patch while it is measured, the engine as it is sees none, and every case is compared."""
    seen = []

    def fake_measure(folder, fp8, *args, **kwargs):
        seen.append((fp8, decode_attention.EARLY_KV, decode_launch.num_splits_for(1, 8, 512, 132)))
        return {name: {"case": name, "step_ms": 2.0 if seen[-1][1] else 1.0, "x_floor": 1.0}
                for name in step_ab.CASES}

    monkeypatch.setattr(step_ab, "check_inputs", lambda *a: None)
    monkeypatch.setattr(step_ab, "ceilings", lambda: (1.0, 1.0))
    monkeypatch.setattr(step_ab, "measure", fake_measure)
    args = argparse.Namespace(bf16="b", fp8="f", kv_gib=1.0, load_format="dummy", max_splits=(16, 4))
    attention_stages.capped_splits(args)
    assert seen == [(fp8, True, cap) for fp8 in (False, True) for cap in (64, 16, 4)]
    seen.clear()
    attention_stages.early_kv_off(args)
    assert seen == [(fp8, early, 64) for fp8 in (False, True) for early in (True, False)]
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"speedup"' in line]
    assert len(lines) == 2 * 2 * 3 + 2 * 3  # (2 caps + early tile) x 2 caches x 3 cases
    assert lines[0]["case"] == "bf16 cache, at most 16 splits vs the engine's count, decode1"
    assert lines[-1]["case"].startswith("fp8 cache, attention without its early tile vs with")
    assert lines[-1]["speedup"] == 2.0


def engines_seeing(monkeypatch, field: str) -> list:
    """step_ab's GPU-only pieces replaced by a recorder: each engine "measured" appends (fp8, the launch field as
    decode_launch's launch_config gives it, as decode_attention's does)."""
    seen = []

    def fake_measure(folder, fp8, *args, **kwargs):
        seen.append((fp8, getattr(decode_launch.launch_config(torch.bfloat16, 128, fp8, 512), field),
                     getattr(decode_attention.launch_config(torch.bfloat16, 128, fp8, 512), field)))
        return {name: {"case": name, "step_ms": 1.0} for name in step_ab.CASES}

    monkeypatch.setattr(step_ab, "measure", fake_measure)
    monkeypatch.setattr(step_ab, "check_inputs", lambda *a: None)
    monkeypatch.setattr(step_ab, "ceilings", lambda: (1e12, 1e15))
    return seen


def test_the_lazy_softmax_variant_reaches_both_launch_config_names(monkeypatch):
    """--lazy on: the second engine's every decode attention launch (decode_attention's name and warm-up's) has the
    lazy softmax; the engine as it is keeps the exact one."""
    seen = engines_seeing(monkeypatch, "lazy")
    attention_stages.lazy_softmax(argparse.Namespace(bf16="b", fp8="f", kv_gib=1.0, load_format="dummy"))
    assert seen == [(False, False, False), (False, True, True), (True, False, False), (True, True, True)]
    assert not decode_launch.launch_config(torch.bfloat16, 128, True, 512).lazy  # undone on leaving


def test_the_stages_mode_builds_only_the_named_caches_engines_with_the_stage_count_patched(monkeypatch):
    seen = engines_seeing(monkeypatch, "num_stages")
    monkeypatch.setattr(sys, "argv", ["attention_stages.py", "--bf16", "b", "--fp8", "f", "--stages", "fp8:5"])
    default = decode_launch.launch_config(torch.bfloat16, 128, True, 512).num_stages
    attention_stages.main()
    assert seen == [(True, default, default), (True, 5, 5)]
