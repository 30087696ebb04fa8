"""One Llama-family decoder layer over a paged KV cache: its RMSNorms and attention, around the MLP of engine.model.mlp
(engine.model.decoder stacks the layers into the model).

Module and parameter names are exactly the Hugging Face ones, so `engine.model.weights.load_weights` maps checkpoint
tensors one to one. Differences between the architectures are config flags: q/k/v bias (Qwen2), q/k RMSNorm
(Qwen3), llama3 rope scaling, sliding window (Mistral).

Two paths, one structure. After loading, `fuse()` makes q/k/v and gate/up one projection each (one GEMM instead of
three and two; each output element is the same dot product). The torch path (CPU) otherwise matches transformers op
for op (RoPE rotates q and k together: the same elementwise ops). With `use_kernels` set (the GPU path) RMSNorm with
the residual add, RoPE with the KV store, SiLU-and-mul and attention run as Triton kernels. A step of at most
SKINNY_ROWS tokens (small-batch decode) runs its qkv, o and gate_up projections as GEMVs (engine.kernels.skinny_gemm;
the down projection's long K suits cuBLAS's split-K better), the qkv one with RoPE and the KV store fused in, the
gate_up one with SiLU-and-mul in its epilogue (engine.model.kernel_linears).

With a TPGroup (engine.model.parallel) a layer is built from the rank's local config (its heads and slice of the
intermediate size) and o/down all-reduce; without one (TP=1) no collective or extra op runs.

FP8 checkpoints (ModelConfig.fp8): the quantized linears are engine.model.fp8_linear.Fp8Linear (swapped in before
the weights are allocated), which run their own FP8 matmul on both paths. On the kernel path the RMSNorm before
q/k/v and gate/up and the SiLU-and-mul before down hand their FP8 linear its activations already quantized (Fp8Rows),
in the same pass (engine.kernels.fp8_quant), and the FP8 qkv projection takes RoPE and the KV store in with it: in
its GEMV at one row (engine.kernels.qkv_rope), in its tensor-core GEMM's epilogue up to fp8_linear.MM_ROWS
(engine.kernels.fp8_mm_rope).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.kernels import interpreting
from engine.model.attention import attend
from engine.model.attention_metadata import AttentionMetadata
from engine.model.fp8_linear import GEMV_ROWS, MM_ROWS, Fp8Linear, Fp8Rows
from engine.model.kernel_linears import SKINNY_ROWS, fuse_linears, kernel_linear
from engine.model.mlp import MLP
from engine.model.model_config import ModelConfig
from engine.model.parallel import TPGroup
from engine.model.rope import apply_rope, rotate
from engine.model.torch_attention import write_kv

# FP8 qkv steps of GEMV_ROWS < rows <= this take RoPE and the KV store into their tensor-core GEMM's epilogue
# (engine.kernels.fp8_mm_rope); benchmarks/step_ab.py --set engine.model.decoder_layer.ROPE_IN_MM_MAX_ROWS=1 times
# the two launches it replaces.
ROPE_IN_MM_MAX_ROWS = MM_ROWS


@dataclass(frozen=True)
class RopeInputs:
    """Rotary inputs of one step. Torch path: cos/sin per token [T, 1, D] in the activation dtype. Kernel path:
    the whole float32 tables [P, D], which the kernel indexes by `positions` [T] itself."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_kernels = False
        self.cpu_fused = False  # bfloat16 rows on the CPU: engine.cpu_kernels.elementwise (use_cpu_elementwise)
        # kernel path: the FP8 linear this norm feeds; its output is then quantized for it (Fp8Rows), unless the
        # step has so few rows that the linear runs weight-only (fp8_linear.GEMV_ROWS)
        self.quantize_for: Fp8Linear | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., dim] -> normed. With `residual`, first x = x + residual; returns (normed, that sum)."""
        if self.use_kernels and x.dim() == 2 and self.quantize_for is not None and x.shape[0] > GEMV_ROWS:
            from engine.kernels.fp8_quant import rms_norm_quant
            rows = Fp8Rows(*rms_norm_quant(x, self.weight, self.eps, residual, self.quantize_for.input_scale))
            return rows if residual is None else (rows, residual)  # residual updated in place
        if self.use_kernels and x.dim() == 2:
            from engine.kernels.rms_norm import rms_norm
            return rms_norm(x, self.weight, self.eps, residual)  # updates residual in place
        if self.cpu_fused and x.dim() == 2 and (residual is None or residual.is_contiguous()):
            from engine.cpu_kernels.elementwise import rms_norm
            return rms_norm(x, self.weight, self.eps, residual)  # updates residual in place
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.qkv_proj: nn.Linear | None = None  # set by fuse(): q, k and v in one GEMM
        self.use_kernels = False
        self.cpu_fused = False  # RoPE and the KV store by engine.cpu_kernels.elementwise (use_cpu_elementwise)
        # an fp8 cache (engine.kv_quant) stores k / k_scale and v / v_scale; other caches ignore them
        self.k_scale, self.v_scale = 1.0, 1.0

    def fuse(self) -> None:
        self.qkv_proj = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, rope: RopeInputs, kv_layer: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden]; kv_layer [NB, 2, bs, KVH, D] -> [T, hidden]."""
        q = self.project(x, rope, kv_layer, meta.slots)
        return self.output(self.attend(q, kv_layer, meta))

    def attend(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D] over kv_layer [NB, 2, bs, KVH, D] (the new K/V stored) -> [T, H, D] (engine.model.attention)."""
        return attend(q, kv_layer, meta, self.head_dim ** -0.5, self.use_kernels, out, self.k_scale, self.v_scale)

    def project(self, x: torch.Tensor, rope: RopeInputs, kv_layer: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
        """The part before attention: x [T, hidden] -> q [T, H, D], with k and v rotated and stored at `slots`."""
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        use_kernels, scales = self.use_kernels, (self.k_scale, self.v_scale)
        if use_kernels and not self.qk_norm and self._fuses_rope(x):
            # one kernel: projection, RoPE, KV store (an FP8 projection's e4m3 GEMV with its scales)
            from engine.kernels.qkv_rope import qkv_rope_store
            proj = self.qkv_proj
            fp8 = {}
            if isinstance(proj, Fp8Linear):  # e4m3 rows with their scales, or 16-bit ones (weight-only)
                fp8 = dict(x_scales=x.scales if isinstance(x, Fp8Rows) else None, w_scales=proj.scale_row,
                           out_dtype=proj.out_dtype)
            qkv = qkv_rope_store(x.q if isinstance(x, Fp8Rows) else x, proj.weight, proj.bias, h, kvh,
                                 rope.positions, rope.cos, rope.sin, kv_layer, slots, *scales, **fp8)  # [T, (H+2KVH)D]
            return qkv[:, : h * d].view(t, h, d)
        if use_kernels and not self.qk_norm and self._fuses_rope_in_mm(x):
            # FP8 tensor cores, RoPE and the KV store in the GEMM's epilogue (engine.kernels.fp8_mm_rope)
            from engine.kernels.fp8_mm_rope import fp8_mm_rope_store
            proj = self.qkv_proj
            qkv = fp8_mm_rope_store(x.q, x.scales, proj.weight, proj.scale_row, proj.bias, h, kvh, rope.positions,
                                    rope.cos, rope.sin, kv_layer, slots, *scales, out_dtype=proj.out_dtype,
                                    semaphores=proj.split_semaphores)  # [T, (H + 2 KVH) D]
            return qkv[:, : h * d].view(t, h, d)
        # bfloat16 on the CPU: RoPE and the store in one C pass (a bfloat16 cache only: an fp8 one takes torch's)
        if self.cpu_fused and not self.qk_norm and kv_layer.dtype == torch.bfloat16:
            from engine.cpu_kernels.elementwise import rope_store
            return rope_store(self.qkv_proj(x), h, kvh, rope.cos, rope.sin, kv_layer, slots)
        if not use_kernels and self.qkv_proj is not None and not self.qk_norm:  # torch path, fused projection
            qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) D]
            qk = rotate(qkv[:, : (h + kvh) * d].view(t, h + kvh, d), rope.cos, rope.sin)  # q and k at once
            write_kv(kv_layer, slots, qk[:, h:], qkv[:, (h + kvh) * d:].view(t, kvh, d), *scales)
            return qk[:, :h]
        q, k, v = self._project_qkv(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if use_kernels:
            from engine.kernels.rope import rope_and_store
            rope_and_store(q, k, v, rope.positions, rope.cos, rope.sin, kv_layer, slots, *scales)
        else:
            q, k = apply_rope(q, k, rope.cos, rope.sin)
            write_kv(kv_layer, slots, k, v, *scales)
        return q

    def _fuses_rope(self, x: torch.Tensor | Fp8Rows) -> bool:
        """Whether the kernel path's one-kernel projection + RoPE + store takes this step: 16-bit weights up to
        SKINNY_ROWS tokens (its GEMV), FP8 ones where their GEMV runs (fp8_linear.GEMV_ROWS, weight-only)."""
        if type(self.qkv_proj) is nn.Linear:
            return x.shape[0] <= SKINNY_ROWS
        return isinstance(self.qkv_proj, Fp8Linear) and x.shape[0] <= GEMV_ROWS

    def _fuses_rope_in_mm(self, x: torch.Tensor | Fp8Rows) -> bool:
        """Whether an FP8 projection's tensor-core step (more than GEMV_ROWS rows, at most MM_ROWS) takes RoPE and
        the store into its epilogue: quantized rows, on CUDA or the interpreter, a tile that divides the head."""
        if not isinstance(self.qkv_proj, Fp8Linear) or not isinstance(x, Fp8Rows):
            return False
        if not GEMV_ROWS < x.q.shape[0] <= min(MM_ROWS, ROPE_IN_MM_MAX_ROWS) or not (x.q.is_cuda or interpreting()):
            return False
        from engine.kernels.fp8_mm_rope import fits_head
        return fits_head(self.head_dim)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """The part after attention: o [T, H, D] -> [T, hidden] (o_proj, then the all-reduce under TP)."""
        o = o.reshape(o.shape[0], self.num_heads * self.head_dim)
        out = kernel_linear(self.o_proj, o) if self.use_kernels else self.o_proj(o)
        return out if self.tp is None else self.tp.all_reduce(out)  # o_proj has no bias

    def _project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, H, D], k and v [T, KVH, D] (views of one output on the kernel path)."""
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is None:
            return self.q_proj(x).view(t, h, d), self.k_proj(x).view(t, kvh, d), self.v_proj(x).view(t, kvh, d)
        qkv = kernel_linear(self.qkv_proj, x) if self.use_kernels else self.qkv_proj(x)
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        return q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs, kv_layer: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (not yet added to the residual stream) -> (this layer's, residual)."""
        q, residual = self.before_attention(x, residual, rope, kv_layer, meta.slots)
        return self.after_attention(self.self_attn.attend(q, kv_layer, meta), residual)

    def before_attention(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs,
                         kv_layer: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (q [T, H, D], residual); the K/V are stored. The kernel path adds into `residual` in place."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        return self.self_attn.project(x, rope, kv_layer, slots), residual

    def after_attention(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention's output o [T, H, D] -> (this layer's output, residual)."""
        x, residual = self.post_attention_layernorm(self.self_attn.output(o), residual)
        return self.mlp(x), residual
