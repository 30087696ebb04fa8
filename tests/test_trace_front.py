"""benchmarks.engine_bench_gpu.kernel_front: where a traced decode step's device time goes, by kernel, when kernels
overlap (programmatic dependent launch starts one before the previous ends). Each kernel is charged how far it moves
the completion front; idle time before it is its own; the host's gaps between calls are nobody's."""

from __future__ import annotations

import gzip
import json

from benchmarks.engine_bench_gpu import HOST_GAP_US, kernel_front


def write_trace(path, spans):
    events = [{"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur} for name, ts, dur in spans]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 0.0, "dur": 5.0})  # not device work
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_overlapping_kernels_are_charged_what_each_adds(tmp_path):
    path = str(tmp_path / "t.json.gz")
    # call 1: gemv 0-10; norm launched early at 8, ends 12 (adds 2); attn starts at 15 after 3 idle, ends 20 (adds 8)
    # then the host's gap; call 2 the same shifted
    shift = HOST_GAP_US + 1000
    spans = []
    for base in (0.0, shift):
        spans += [("gemv", base, 10.0), ("norm", base + 8, 4.0), ("attn", base + 15, 5.0)]
    write_trace(path, spans)
    rows = kernel_front(path, calls=2)
    by = {r["front"]: r for r in rows}
    assert by["summary"]["us_per_call"] == 20.0
    assert by["norm"]["us_per_call"] == 2.0 and by["norm"]["per_call"] == 1.0
    assert by["attn"]["us_per_call"] == 8.0  # 3 idle + its 5
    assert by["gemv"]["us_each"] == 10.0  # its own duration: the host's gap before call 2 is nobody's


def test_one_kernel_name_is_charged_per_launch_grid(tmp_path):
    """fp8_mm runs q/k/v, o, gate_up and down: the trace's grid tells them apart (a kernel without one keeps its
    bare name)."""
    path = str(tmp_path / "t.json.gz")
    events = [{"ph": "X", "cat": "kernel", "name": "mm", "ts": 0.0, "dur": 4.0, "args": {"grid": [160, 1, 1]}},
              {"ph": "X", "cat": "kernel", "name": "mm", "ts": 4.0, "dur": 6.0, "args": {"grid": [896, 1, 1]}},
              {"ph": "X", "cat": "kernel", "name": "norm", "ts": 10.0, "dur": 1.0}]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    by = {r["front"]: r for r in kernel_front(path, calls=1)}
    assert by["mm grid=[160, 1, 1]"]["us_each"] == 4.0 and by["mm grid=[896, 1, 1]"]["us_each"] == 6.0
    assert by["norm"]["us_each"] == 1.0 and by["summary"]["us_per_call"] == 11.0
