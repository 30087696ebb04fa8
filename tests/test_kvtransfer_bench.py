"""`python benchmarks/kvtransfer_bench.py` on the CPU: two processes, one JSON line per case, every case bit-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)


def test_bench_prints_correct_json_cases() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "UCX_WARN_UNUSED_ENV_VARS": "n"}
    out = subprocess.run(
        [sys.executable, "benchmarks/kvtransfer_bench.py", "--tokens", "48", "--repeat", "1", "--warmup", "1"],
        cwd=root, env=env, capture_output=True, text=True, timeout=150, check=True,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    cases = [r for r in rows if "op" in r]
    assert {(r["op"], r["pattern"]) for r in cases} == {
        (op, p) for op in ("read", "write") for p in ("scattered", "contiguous")
    }
    for r in cases:
        assert r["correct"] is True
        assert r["blocks"] == 3 and r["bytes"] == 3 * 2 * 1024 * 1024
        assert r["gbps"] > 0 and r["peer_copy_gbps"] > 0 and r["ratio"] > 0
    assert [r["staging_in_use_after"] for r in rows if "staging_in_use_after" in r] == [{"src": 0, "dst": 0}]
