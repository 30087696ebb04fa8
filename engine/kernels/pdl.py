"""Programmatic dependent launch (PDL) for the decode step's kernels: who may start before the kernel before it ends.

A decode step at batch 1 is ~290 short dependent kernels; each boundary costs a few microseconds of an idle GPU (the
previous kernel's last wave draining, the next one's launch and its first DRAM round trip). On Hopper (compute
capability 9.0+) a kernel launched with PDL may be scheduled while the kernel before it still runs, and waits on the
device (`griddepcontrol.wait`) until that kernel has completed and its writes are visible. The rule every kernel
that takes a `PDL` constexpr keeps: before `wait_for_inputs` it reads only what no kernel of the step writes after
the step's inputs are set (weights, the step's input buffers), and it writes nothing. That holds transitively: a
kernel can only have started early once the kernel before it passed its own wait, so everything older than its
direct predecessor is complete. The GEMVs (engine.kernels.skinny_gemm.gemv_tile) request their first weight tile
before waiting, so the weight stream starts under the previous kernel's tail.

`PDSERVE_PDL=0` launches every kernel the ordinary way (benchmarks/fp8_gpu.py `pdl` compares both in one run).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from engine.kernels import interpreting


def pdl_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: a CUDA device of compute capability 9.0+, not the interpreter,
    and PDSERVE_PDL not "0". Callers pass it as both the kernel's PDL constexpr and Triton's `launch_pdl`."""
    if device.type != "cuda" or interpreting() or os.environ.get("PDSERVE_PDL", "1") == "0":
        return False
    return _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _hopper_or_later(index: int) -> bool:
    # a fact of the hardware, asked once per device: this runs at every kernel launch of an eager step
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    # Under PDL: block until the previous kernel has completed (its writes visible), then let the next kernel be
    # scheduled once every program of this one has got here (it will wait for this one's end in turn). A no-op
    # otherwise; the interpreter has neither instruction, so PDL is False there.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_args(device: torch.device) -> dict[str, bool]:
    """The launch's keyword arguments: a kernel's `PDL` constexpr and Triton's `launch_pdl`, both pdl_launch."""
    on = pdl_launch(device)
    return {"PDL": on, "launch_pdl": on}
