"""Programmatic dependent launch (PDL) for the decode step's kernels: who may start before the kernel before it ends.

A decode step at batch 1 is ~290 short dependent kernels; each boundary costs a few microseconds of an idle GPU (the
previous kernel's last wave draining, the next one's launch and its first DRAM round trip). On Hopper (compute
capability 9.0+) a kernel launched with PDL may be scheduled while the kernel before it still runs, and waits on the
device (`griddepcontrol.wait`) until that kernel has completed and its writes are visible. The rule every kernel
that takes a `PDL` constexpr keeps: before `wait_for_inputs` it reads only what no kernel of the step writes after
the step's inputs are set (weights, the step's input buffers; for decode attention also the KV of positions older
than each row's new token, which only earlier steps and kernels before the layers wrote), and it writes nothing.
That holds transitively: a kernel can only have started early once the kernel before it passed its own wait, so
everything older than its direct predecessor is complete. The GEMVs (engine.kernels.skinny_gemm.gemv_tile) request
their first weight tile before waiting, so the weight stream starts under the previous kernel's tail.

Small steps (MAX_ROWS) launch this way with each program letting the next kernel be scheduled right after its wait,
so that kernel's early reads overlap all of this one. The kernels only FP8 linears launch (engine.kernels.fp8_gemm's
fp8_mm, engine.kernels.fp8_quant's) do so up to LATE_MAX_ROWS too, past MAX_ROWS "late": a program lets the next
kernel be scheduled only once its main loop is done (`dependents_may_start`), so the next kernel's launch and first
reads overlap this one's tail (its last programs' epilogues, split-K merges) without its programs taking SM room
while this one's still run. `PDSERVE_PDL=0` launches every kernel the ordinary way (benchmarks/fp8_gpu.py `pdl`
compares both in one run).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from engine.kernels import interpreting

# Steps of at most this many rows launch with PDL. 8B shape on one H200 (`bash benchmarks/gpu_run.sh pdl`, 2026-12-03,
# docs/benchmarks.md): FP8 weights + fp8 KV 1.053 / 1.064 / 1.032x faster at batch 1 / 4 / 16, but 0.991 / 0.955x
# at 32 / 64; bfloat16 1.017 / 1.019 / 1.006 / 1.005 / 0.999x. Past a few rows a kernel is long next to its gaps.
MAX_ROWS = 16
# FP8 linears' kernels of steps of MAX_ROWS < rows <= LATE_MAX_ROWS launch with PDL and late triggers (module
# docstring). One H100, 8B shape, FP8 weights + fp8 KV, every Triton kernel of the step late (benchmarks/step_ab.py
# --set engine.kernels.pdl.LATE_MAX_ROWS=64, 2026-12-06): batch 32 / 64 at 2k 1.019 / 1.023x faster (early
# triggers there: 1.006 / 1.017x); bf16 weights (cuBLAS GEMMs between the Triton kernels) 0.993 / 0.994x, hence
# only the FP8 linears' kernels; FP8 at batch 128 (cuBLAS's FP8 GEMMs) 0.992x, hence 64.
LATE_MAX_ROWS = 64


def pdl_launch(device: torch.device, rows: int = 1, late: bool = False) -> bool:
    """Whether a kernel over `rows` rows (tokens or sequences) on `device` launches with PDL: a CUDA device of compute
    capability 9.0+, not the interpreter, PDSERVE_PDL not "0", and rows <= MAX_ROWS (or, for a kernel that may
    trigger `late`, LATE_MAX_ROWS). Callers pass it as both the kernel's PDL constexpr and Triton's `launch_pdl`
    (pdl_args)."""
    if rows > (max(MAX_ROWS, LATE_MAX_ROWS) if late else MAX_ROWS) or device.type != "cuda" or interpreting():
        return False
    if os.environ.get("PDSERVE_PDL", "1") == "0":
        return False
    return _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _hopper_or_later(index: int) -> bool:
    # a fact of the hardware, asked once per device: this runs at every kernel launch of an eager step
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def wait_for_inputs(PDL: tl.constexpr, LATE: tl.constexpr = False):
    # Under PDL: block until the previous kernel has completed (its writes visible), then (unless LATE) let the next
    # kernel be scheduled once every program of this one has got here (it will wait for this one's end in turn). A
    # no-op otherwise; the interpreter has neither instruction, so PDL is False there.
    if PDL:
        tl.extra.cuda.gdc_wait()
        if not LATE:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def dependents_may_start(PDL: tl.constexpr, LATE: tl.constexpr):
    # A LATE launch's trigger, after the program's main loop: the next kernel may be scheduled once every program of
    # this one has got here or ended. A no-op for early (already triggered) or ordinary launches.
    if PDL:
        if LATE:
            tl.extra.cuda.gdc_launch_dependents()


def pdl_args(device: torch.device, rows: int, late: bool = False) -> dict[str, bool]:
    """The launch's keyword arguments: a kernel's `PDL` constexpr and Triton's `launch_pdl`, both pdl_launch, and its
    `PDL_LATE` constexpr (a PDL launch of more than MAX_ROWS rows: its trigger after the main loop). `late`: the
    kernel is one of the FP8 linears' (module docstring)."""
    on = pdl_launch(device, rows, late)
    return {"PDL": on, "PDL_LATE": on and rows > MAX_ROWS, "launch_pdl": on}
