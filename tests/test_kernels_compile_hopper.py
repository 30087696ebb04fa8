"""The decode step's Triton kernels compile for Hopper (sm_90, the H100/H200 they serve on) on any machine, CPU
CI included: the interpreter CPU tests run accepts code the compiler refuses (how `kv_cache_dtype: fp8` once passed
every CPU test and failed on an H200), and under programmatic dependent launch each kernel carries its wait and its
trigger (engine.kernels.pdl), and neither without it (a late trigger after the main loop's MMAs, an early one
before them); none spills registers to local memory, and the fp8-cache
decode attention reads no shared memory a byte at a time (compiled with the
divisibility a launch on the 8B shape specialises on: without it the FP8 GEMM's build spilled 2.7 KB a thread).
Compiled by Triton's own ptxas in a process of its own, without TRITON_INTERPRET (tests/hopper_compile.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_decode_kernels_compile_for_hopper_with_their_pdl_wait():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "tests.hopper_compile"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) >= 69, out.stdout
    assert all(any(r["late"] and r["kernel"] == k for r in rows) for k in {r["kernel"] for r in rows})
    failed = [r for r in rows if "error" in r]
    assert not failed, json.dumps(failed, indent=1)
    for r in rows:
        assert r["cubin_bytes"] > 0
        assert r["wait"] == r["launch_dependents"] == r["pdl"], r
        if r["trigger_after_mma"] is not None:  # a late trigger after the main loop's MMAs, an early one before
            assert r["trigger_after_mma"] == r["late"], r
        assert r["local_stores"] in (0, None), r
        if r["constexprs"].get("V_WORDS"):  # the fp8 cache's V widened before its transpose, not byte by byte
            assert r["byte_shared_loads"] in (0, None), r
