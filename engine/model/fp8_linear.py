"""FP8 (e4m3) linear layers: the checkpoint's FP8 weights and scales, and how a matmul runs on them.

Owns: `Fp8Linear` (named like the checkpoint: `weight` float8_e4m3fn [out, in], `weight_scale` float32 [1] or
[out, 1], `input_scale` [1] with static activations, `bias` in the compute dtype), `swap_in_fp8` (replace the
model's nn.Linear layers the scheme quantizes, on the meta device before the weights are allocated),
`finish_fp8` (after loading: every scale as one float32 row [1, out]), `fuse_fp8` (q/k/v or gate/up as one layer,
exactly: each output row keeps its own scale), `fp8_scale_slices` (tensor parallelism: a per-channel scale is cut
with its column-parallel weight's rows and replicated with a row-parallel one), `quantize_rows`.

A matmul: the activations x [M, K] are quantized to e4m3 per token (dynamic: each row's amax / 448) or with the
stored per-tensor scale (static); then y = (x_q @ w_q^T) * s_x[M, 1] * s_w[1, N] (+ bias), in the compute dtype.
On the kernel path (`use_kernels`, set by CausalLM.use_kernels: the GPU, or the Triton interpreter in CPU tests) the
activations arrive already quantized as `Fp8Rows` where the op before could do it in its own pass (RMSNorm before
q/k/v and gate/up, SiLU-and-mul before down: engine.kernels.fp8_quant), else one kernel quantizes them; the matmul
is chosen by M (the step's tokens), from timings on an H200 (docs/benchmark-log.md): a GEMV over the e4m3 weight for
the smallest decode batches, FP8 tensor cores with the operands swapped for the rest of the decode sizes
(engine.kernels.fp8_gemm), and cuBLASLt's `torch._scaled_mm` with row-wise scales for prefill. All three compute
the same products in float32 with the same scales. Up to GEMV_ROWS tokens the activations are not quantized at all
("weight-only": the GEMV upcasts the e4m3 weight and multiplies the 16-bit activations, so the step spends no
launch on quantizing them; the model's norms and SiLU-and-mul then hand over 16-bit rows): at one row the
quantizing kernels cost more than the weight read they would save (docs/benchmark-log.md), and the result is
closer to the 16-bit model, not further. On the torch path (the CPU) the weight stays FP8 in memory and
is upcast to float32 per matmul (exact: every e4m3 value and every product of two is a float32), with the same
activation quantization, so the CPU computes the numbers the GPU does up to the order of float32 sums; CI
measures real FP8 serving accuracy with it. Upcasting once at load would be faster on a CPU but would hold the
model at twice the bytes and skip the activation rounding the GPU does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from torch import nn

from engine.model.quant_config import Fp8Scheme

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # a row of zeros still gets a finite scale
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
# kernel path, by M: fp8_gemv (weight-only) up to GEMV_ROWS, fp8_mm up to MM_ROWS, torch._scaled_mm beyond. H200
# sweep of an 8B layer (benchmarks/fp8_gpu.py gemm-sweep): the GEMV wins at M = 1 only; fp8_mm up to 64 (0.080 ms a
# layer at 64 against _scaled_mm's 0.107); _scaled_mm from 128 (0.106 ms against fp8_mm's 0.124) through prefill.
GEMV_ROWS = 1
MM_ROWS = 64


@dataclass(frozen=True)
class Fp8Rows:
    """Activations already quantized for an Fp8Linear: q [M, K] e4m3 and scales [M, 1] float32 (x ~= q * scales)."""

    q: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, K] e4m3, scales [M, 1] float32) with x ~= x_q * scales: per row (dynamic) or the
    stored per-tensor `input_scale` [1] (static)."""
    xf = x.float()
    if input_scale is None:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)  # [M, 1]
    else:
        scale = input_scale.view(1, 1).expand(x.shape[0], 1).contiguous()
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear(nn.Module):
    """y = x @ W^T (+ bias) with W stored as e4m3 and its scales; x [..., in] -> [..., out] in `out_dtype`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: Fp8Scheme,
                 out_dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, out_dtype
        frozen = dict(requires_grad=False)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device), **frozen)
        scale_shape = (out_features, 1) if scheme.weight_strategy == "channel" else (1,)
        self.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32, device=device), **frozen)
        self.input_scale = None
        if scheme.activations == "static":
            self.input_scale = nn.Parameter(torch.empty(1, dtype=torch.float32, device=device), **frozen)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=out_dtype, device=device), **frozen)
        self.scale_row: torch.Tensor | None = None  # [1, out] float32, set by finish()
        self.use_kernels = False  # the Triton/cuBLASLt path (module docstring), set by CausalLM.use_kernels
        self.split_semaphores: torch.Tensor | None = None  # fp8_mm's split-K meeting points, made by finish()

    def finish(self) -> None:
        """After loading: the weight scale as one contiguous float32 row [1, out] (a per-tensor scale repeated)."""
        s = self.weight_scale.detach().float().reshape(-1)
        if s.numel() not in (1, self.out_features):
            raise ValueError(f"weight_scale has {s.numel()} values for {self.out_features} output rows")
        self.scale_row = s.expand(self.out_features).reshape(1, -1).contiguous()
        # fp8_mm's split-K meeting points, one per output tile up to MM_ROWS tokens (it leaves them zero); kept here
        # so a CUDA graph's replay needs no memset. One step at a time uses them (the engine runs one stream).
        self.split_semaphores = None
        if self.weight.is_cuda:
            tiles = triton.cdiv(self.out_features, 16) * triton.cdiv(MM_ROWS, 16)
            self.split_semaphores = torch.zeros(tiles, dtype=torch.int32, device=self.weight.device)

    def matmul(self, x: torch.Tensor | Fp8Rows, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in] (or its Fp8Rows) -> x @ W^T (+ `bias`) [M, out] in out_dtype. A row-parallel layer passes no
        bias (it adds it after the sum over ranks)."""
        if self.scale_row is None:
            raise RuntimeError("Fp8Linear used before finish() (its scales are not prepared)")
        if self.use_kernels:
            return self._kernel_matmul(x, bias)
        xq, xs = (x.q, x.scales) if isinstance(x, Fp8Rows) else quantize_rows(x, self.input_scale)
        y = ((xq.float() @ self.weight.float().t()) * xs * self.scale_row).to(self.out_dtype)
        return y if bias is None else y + bias

    def _kernel_matmul(self, x: torch.Tensor | Fp8Rows, bias: torch.Tensor | None) -> torch.Tensor:
        from engine.kernels.fp8_gemm import fp8_gemv, fp8_mm
        if not isinstance(x, Fp8Rows):
            if x.shape[0] <= GEMV_ROWS:  # weight-only (module docstring)
                return fp8_gemv(x, None, self.weight, self.scale_row, bias, self.out_dtype)
            from engine.kernels.fp8_quant import quantize_rows as quantize_kernel
            x = Fp8Rows(*quantize_kernel(x, self.input_scale))
        m = x.q.shape[0]
        if m <= GEMV_ROWS:
            return fp8_gemv(x.q, x.scales, self.weight, self.scale_row, bias, self.out_dtype)
        # torch._scaled_mm's row-wise scales need a bfloat16 output (and CUDA); other dtypes stay on Triton
        if m <= MM_ROWS or not x.q.is_cuda or self.out_dtype != torch.bfloat16:
            return fp8_mm(x.q, x.scales, self.weight, self.scale_row, bias, self.out_dtype,
                          semaphores=self.split_semaphores)
        return torch._scaled_mm(x.q, self.weight.t(), scale_a=x.scales, scale_b=self.scale_row, bias=bias,
                                out_dtype=self.out_dtype)

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """x [M <= GEMV_ROWS, in] 16-bit, this layer a fused [gate; up] -> silu(gate) * up [M, out / 2] in out_dtype:
        the weight-only GEMV with the activation in its epilogue (engine.kernels.fp8_gemm.fp8_gemv, gated)."""
        from engine.kernels.fp8_gemm import fp8_gemv
        if self.scale_row is None:
            raise RuntimeError("Fp8Linear used before finish() (its scales are not prepared)")
        return fp8_gemv(x, None, self.weight, self.scale_row, self.bias, self.out_dtype, gated=True)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        if isinstance(x, Fp8Rows):
            return self.matmul(x, self.bias)
        lead = x.shape[:-1]
        y = self.matmul(x.reshape(-1, self.in_features), self.bias)
        return y.reshape(*lead, self.out_features)


def swap_in_fp8(model: nn.Module, scheme: Fp8Scheme, out_dtype: torch.dtype) -> int:
    """Replace every nn.Linear of `model` that `scheme` quantizes by an Fp8Linear of its shape (on its device:
    call on the meta device, after the dtype conversion, which would otherwise upcast the FP8 weights); how many."""
    swapped = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is nn.Linear and scheme.quantizes(full):
                setattr(parent, name, Fp8Linear(child.in_features, child.out_features, child.bias is not None,
                                                scheme, out_dtype, device=child.weight.device))
                swapped += 1
    return swapped


def finish_fp8(model: nn.Module) -> None:
    """After the weights are loaded: every Fp8Linear's scales prepared (Fp8Linear.finish)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.finish()


def fuse_fp8(*layers: Fp8Linear) -> Fp8Linear:
    """One Fp8Linear whose output is the concatenation of the given ones' (same input), exactly: weights and the
    per-row scales are concatenated; a static input scale becomes the largest of theirs (the weights are exact, the
    activation is quantized once; with equal input scales, as ModelOpt usually writes for q/k/v, nothing changes)."""
    first = layers[0]
    weight = torch.cat([lin.weight.data for lin in layers])  # [sum of outs, in] e4m3
    static = first.input_scale is not None
    scheme = Fp8Scheme("fused", "channel", "static" if static else "dynamic")
    fused = Fp8Linear(weight.shape[1], weight.shape[0], first.bias is not None, scheme, first.out_dtype,
                      device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    fused.weight_scale = nn.Parameter(torch.cat([lin.scale_row.reshape(-1, 1) for lin in layers]),
                                      requires_grad=False)  # [sum of outs, 1]
    if static:
        fused.input_scale = nn.Parameter(torch.stack([lin.input_scale.data for lin in layers]).amax().reshape(1),
                                         requires_grad=False)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([lin.bias.data for lin in layers]), requires_grad=False)
    fused.finish()
    return fused


def fp8_scale_slices(slices: dict[str, tuple[int, int, int, int]], scheme: Fp8Scheme | None
                     ) -> dict[str, tuple[int, int, int, int]]:
    """`slices` (engine.model.tp_layout.TPLayout.slices) plus the per-channel weight scales of the column-parallel
    linears, cut like their weights' rows. Per-tensor and input scales, and a row-parallel layer's per-channel
    scale (one per output row, which every rank holds whole), are replicated: absent from the map."""
    if scheme is None or scheme.weight_strategy != "channel":
        return dict(slices)
    out = dict(slices)
    for name, cut in slices.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in COLUMN_PARALLEL and cut[0] == 0:
            out[module + ".weight_scale"] = cut
    return out
