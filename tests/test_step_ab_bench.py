"""benchmarks/step_ab.py on the CPU: its --set parsing, its refusal without a GPU, and that each variant's engine
is built and timed inside its patches (the GPU-only parts replaced by a recorder)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import step_ab
from engine.kernels import fp8_gemm, fp8_quant

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_ab.py"


def test_settings_are_parsed_into_literals():
    assert step_ab.parse_setting("engine.kernels.fp8_quant.SPLIT_ROWS=64") == [
        ("engine.kernels.fp8_quant.SPLIT_ROWS", 64)]
    assert step_ab.parse_setting("engine.kernels.fp8_quant.SPLIT_ROWS=64; engine.kernels.fp8_gemm.WIDE_MIN_BLOCK_M=128"
                                 ) == [("engine.kernels.fp8_quant.SPLIT_ROWS", 64),
                                       ("engine.kernels.fp8_gemm.WIDE_MIN_BLOCK_M", 128)]


@pytest.mark.parametrize("text,why", [("SPLIT_ROWS=64", "expected engine.MODULE.NAME=VALUE"),
                                      ("engine.kernels.fp8_quant.SPLIT_ROWS", "expected engine.MODULE.NAME=VALUE"),
                                      ("engine.kernels.nope.X=1", "no module engine.kernels.nope"),
                                      ("engine.kernels.fp8_quant.NOPE=1", "has no NOPE"),
                                      ("engine.kernels.fp8_quant.SPLIT_ROWS=sixty", "is not a Python literal"),
                                      ("torch.cuda.X=1", "expected engine.MODULE.NAME=VALUE")])
def test_bad_settings_are_refused_by_name(text, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        step_ab.parse_setting(text)


def test_the_script_stops_at_its_machine_check_without_a_gpu(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(SCRIPT), "--bf16", str(tmp_path), "--fp8", str(tmp_path), "--set",
                          "engine.kernels.fp8_quant.SPLIT_ROWS=64"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert run.returncode == 1 and "no CUDA device" in run.stderr, run.stderr[-2000:]


def test_each_variant_engine_sees_its_constants_and_the_engine_as_it_is_none(monkeypatch, capsys):
    seen = []

    def fake_measure(folder, fp8, *args, **kwargs):
        seen.append((fp8, fp8_quant.SPLIT_ROWS, fp8_gemm.WIDE_MIN_BLOCK_M))
        return {name: {"case": name, "step_ms": 1.0} for name in step_ab.CASES}

    monkeypatch.setattr(step_ab, "measure", fake_measure)
    monkeypatch.setattr(step_ab, "check_inputs", lambda *a: None)
    monkeypatch.setattr(step_ab, "ceilings", lambda: (1e12, 1e15))
    rows, wide = fp8_quant.SPLIT_ROWS, fp8_gemm.WIDE_MIN_BLOCK_M
    monkeypatch.setattr(sys, "argv", ["step_ab.py", "--bf16", "b", "--fp8", "f", "--set",
                                      "engine.kernels.fp8_quant.SPLIT_ROWS=64", "--set",
                                      "engine.kernels.fp8_gemm.WIDE_MIN_BLOCK_M=128"])
    step_ab.main()
    assert seen == [(False, rows, wide), (False, 64, wide), (False, rows, 128),
                    (True, rows, wide), (True, 64, wide), (True, rows, 128)]
    assert (fp8_quant.SPLIT_ROWS, fp8_gemm.WIDE_MIN_BLOCK_M) == (rows, wide)  # undone on leaving
    out = capsys.readouterr().out
    assert "engine.kernels.fp8_quant.SPLIT_ROWS=64 vs as it is" in out


def test_only_one_engine_is_built_when_asked(monkeypatch):
    seen = []
    monkeypatch.setattr(step_ab, "measure", lambda folder, fp8, *a, **k: seen.append(fp8) or {
        name: {"case": name, "step_ms": 1.0} for name in step_ab.CASES})
    monkeypatch.setattr(step_ab, "check_inputs", lambda *a: None)
    monkeypatch.setattr(step_ab, "ceilings", lambda: (1e12, 1e15))
    monkeypatch.setattr(sys, "argv", ["step_ab.py", "--bf16", "b", "--fp8", "f", "--only", "fp8", "--set",
                                      "engine.kernels.fp8_quant.SPLIT_ROWS=64"])
    step_ab.main()
    assert seen == [True, True]


def test_cases_are_named_or_batch_by_context_and_reach_the_engines(monkeypatch):
    assert step_ab.parse_cases("decode64, 128x1024") == ("decode64", "128x1024")
    for bad in ("128x", "x1024", "0x1024", "decode32", "128*1024"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected decode1, decode64, long or BATCHxCONTEXT"):
            step_ab.parse_cases(bad)
    seen = []
    monkeypatch.setattr(step_ab, "measure", lambda folder, fp8, bw, fl, kv, lf, cases, **k: seen.append(
        list(cases)) or {name: {"case": name, "step_ms": 1.0} for name in cases})
    monkeypatch.setattr(step_ab, "check_inputs", lambda *a: None)
    monkeypatch.setattr(step_ab, "ceilings", lambda: (1e12, 1e15))
    monkeypatch.setattr(sys, "argv", ["step_ab.py", "--bf16", "b", "--fp8", "f", "--only", "bf16", "--cases",
                                      "128x1024", "--set", "engine.kernels.fp8_quant.SPLIT_ROWS=128"])
    step_ab.main()
    assert seen == [["128x1024"], ["128x1024"]]


def test_a_decode_case_by_its_size_sizes_the_engine():
    from benchmarks.fp8_gpu import CASES, LONG_CONTEXT, decode_case
    assert decode_case("decode1") == CASES[0] and decode_case("long") == LONG_CONTEXT
    assert decode_case("256x512") == (256, 512)


def test_fp8_gpu_decode_runs_the_cases_given_with_only_and_refuses_them_without(monkeypatch):
    """fp8_gpu.py decode --only fp8 --cases 4x1024 --only-kv fp8: one engine, those cases, that cache; --cases or
    --only-kv without --only would be ignored by the full comparison, so they are refused."""
    from benchmarks import fp8_gpu
    seen = []
    monkeypatch.setattr(fp8_gpu, "measure", lambda folder, fp8, bw, fl, kv, lf, cases, **k: seen.append(
        (folder, fp8, list(cases), k["kv_cache_dtype"])))
    monkeypatch.setattr(fp8_gpu, "check_inputs", lambda *a: None)
    monkeypatch.setattr(fp8_gpu, "ceilings", lambda: (1e12, 1e15))
    monkeypatch.setattr(fp8_gpu.torch.cuda, "get_device_name", lambda: "no device: measure is recorded")
    monkeypatch.setattr(sys, "argv", ["fp8_gpu.py", "decode", "--bf16", "b", "--fp8", "f", "--skip-attention",
                                      "--only", "fp8", "--cases", "4x1024,prefill", "--only-kv", "fp8"])
    fp8_gpu.main()
    assert seen == [("f", True, ["4x1024", "prefill"], "fp8")]
    monkeypatch.setattr(sys, "argv", ["fp8_gpu.py", "decode", "--bf16", "b", "--fp8", "f", "--cases", "4x1024"])
    with pytest.raises(SystemExit, match="give --only"):
        fp8_gpu.main()
    with pytest.raises(argparse.ArgumentTypeError, match="decode case 'prefil'"):
        fp8_gpu.case_names("decode1,prefil")
    with pytest.raises(argparse.ArgumentTypeError, match="decode case 'prefill'"):
        step_ab.parse_cases("prefill")
