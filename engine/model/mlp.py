"""The Llama-family MLP, down_proj(silu(gate_proj(x)) * up_proj(x)), on its three paths (engine.model.decoder_layer
holds the layer around it).

After loading, `fuse()` makes gate and up one projection ([gate; up]). The torch path matches transformers op for op;
the CPU's bfloat16 rows take SiLU-and-mul as one C pass (engine.cpu_kernels.elementwise). On the kernel path a step of
a few rows gets SiLU-and-mul from the gate/up GEMV's epilogue (engine.model.kernel_linears.gated_linear); an FP8
projection's tensor-core step of up to fp8_linear.MM_ROWS rows from its GEMM's epilogue, quantized for down_proj
(engine.kernels.fp8_mm_swiglu); larger ones from a SiLU-and-mul kernel after the GEMM (quantizing too when down_proj
is FP8: engine.kernels.fp8_quant). With a TPGroup down_proj is row-parallel (its sum over the ranks).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels import interpreting
from engine.model.fp8_linear import GEMV_ROWS, MM_ROWS, Fp8Linear, Fp8Rows
from engine.model.kernel_linears import fuse_linears, gated_linear, kernel_linear
from engine.model.model_config import ModelConfig
from engine.model.parallel import TPGroup

# FP8 gate/up steps of GEMV_ROWS < rows <= this take SwiGLU into their tensor-core GEMM's epilogue
# (engine.kernels.fp8_mm_swiglu); benchmarks/step_ab.py --set engine.model.mlp.SWIGLU_IN_MM_MAX_ROWS=1 times the
# launches it replaces.
SWIGLU_IN_MM_MAX_ROWS = MM_ROWS


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_proj: nn.Linear | None = None  # set by fuse(): gate and up in one GEMM
        self.use_kernels = False
        self.cpu_fused = False  # SiLU-and-mul by engine.cpu_kernels.elementwise (use_cpu_elementwise)

    def fuse(self) -> None:
        self.gate_up_proj = fuse_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = gated_linear(self.gate_up_proj, x) if self.use_kernels else None  # a few rows: from the GEMV itself
        if act is None:
            act = self._activation(x)  # [T, I]
        return self.down_proj(act) if self.tp is None else self.tp.row_parallel(self.down_proj, act)

    def _activation(self, x: torch.Tensor) -> torch.Tensor | Fp8Rows:
        if self.use_kernels and self._swiglu_in_mm(x):
            # FP8 tensor cores with SwiGLU in the GEMM's epilogue, then the quantization (engine.kernels.fp8_mm_swiglu)
            from engine.kernels.fp8_mm_swiglu import fp8_mm_swiglu_quant
            proj = self.gate_up_proj
            return Fp8Rows(*fp8_mm_swiglu_quant(x.q, x.scales, proj.weight, proj.scale_row, proj.bias,
                                                self.down_proj.input_scale, proj.out_dtype, proj.split_semaphores))
        if self.use_kernels and isinstance(self.down_proj, Fp8Linear) and x.shape[0] > GEMV_ROWS:
            from engine.kernels.fp8_quant import silu_mul_quant
            return Fp8Rows(*silu_mul_quant(kernel_linear(self.gate_up_proj, x), self.down_proj.input_scale))
        if self.use_kernels:
            from engine.kernels.silu_mul import silu_and_mul
            return silu_and_mul(kernel_linear(self.gate_up_proj, x))  # [T, 2I] -> [T, I]
        if self.cpu_fused:
            from engine.cpu_kernels.elementwise import silu_mul
            return silu_mul(self.gate_up_proj(x))  # [T, 2I] -> [T, I]
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
            return nn.functional.silu(gate) * up
        return nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)

    def _swiglu_in_mm(self, x: torch.Tensor | Fp8Rows) -> bool:
        """Whether an FP8 gate/up projection's tensor-core step (more than GEMV_ROWS rows, at most MM_ROWS) takes
        SwiGLU into its epilogue: quantized rows in, an FP8 down_proj after, on CUDA or the interpreter."""
        if not (isinstance(self.gate_up_proj, Fp8Linear) and isinstance(self.down_proj, Fp8Linear)
                and isinstance(x, Fp8Rows)):
            return False
        return GEMV_ROWS < x.q.shape[0] <= min(MM_ROWS, SWIGLU_IN_MM_MAX_ROWS) and (x.q.is_cuda or interpreting())
