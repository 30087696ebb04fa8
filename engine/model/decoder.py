"""The Llama-family causal LM (Llama 2/3/3.x, Mistral, Qwen2, Qwen3) over a paged KV cache: embeddings, the decoder
layers (engine.model.decoder_layer, which says how a layer runs on each path), the final norm and the LM head, and
the switches that choose a path for the whole model after loading (`use_kernels`, the CPU kernels, packed linears).
Tied embeddings are a config flag; with a TPGroup the embedding and LM head are split by vocabulary rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.kv_quant import KVScales
from engine.model import torch_attention
from engine.model.attention_metadata import AttentionMetadata
from engine.model.decoder_layer import Attention, DecoderLayer, RMSNorm, RopeInputs
from engine.model.fp8_linear import Fp8Linear
from engine.model.mlp import MLP
from engine.model.model_config import ModelConfig
from engine.model.parallel import TPGroup, VocabParallelEmbedding
from engine.model.rope import RotaryEmbedding
from engine.model.tp_layout import TPLayout


class CausalLM(nn.Module):
    """forward() runs the layers over the step's tokens, writing their K/V into the cache;
    compute_logits() projects the hidden states of the tokens that sample.
    With `tp`, `config` is the rank's local config (engine.model.parallel.TPLayout.local_config)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.model = nn.Module()
        if tp is None:
            # a weight given: no random init (its normal_ on the meta device costs ~2 s of torch imports)
            self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                                   _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
            vocab_rows = cfg.vocab_size
        else:
            layout = TPLayout(cfg, tp.rank, tp.size)
            vocab_rows, cfg = layout.vocab_rows, layout.local_config()
            self.model.embed_tokens = VocabParallelEmbedding(vocab_rows, cfg.hidden_size, layout.vocab_range[0], tp)
        self.config = cfg
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, vocab_rows, bias=False)
        self.cpu_decode_kernel = False  # torch path: decode attention by engine.cpu_kernels (use_cpu_decode_kernel)
        self.cpu_prefill_kernel = False  # ... and prefill attention (use_cpu_prefill_kernel)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions [T]; kv_cache [NB, L, 2, bs, KVH, D] -> final hidden states [T, hidden].
        `on_layer_done(i)` runs after layer i has written its K/V (the hook for layer-wise KV streaming)."""
        x = self.model.embed_tokens(input_ids)
        if self.kernels_enabled:
            rope = RopeInputs(positions, self.rope.cos, self.rope.sin)
        else:
            rope = RopeInputs(positions, *self.rope(positions, x.dtype))
            meta = torch_attention.with_plan(meta, kv_cache, self.cpu_decode_kernel, self.cpu_prefill_kernel)
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, rope, kv_cache[:, i], meta)
            if on_layer_done is not None:
                on_layer_done(i)
        return self.model.norm(x, residual)[0]

    @property
    def kernels_enabled(self) -> bool:
        return self.model.layers[0].self_attn.use_kernels

    def fuse_projections(self) -> None:
        """After the weights are loaded: q/k/v and gate/up as one projection each (both paths)."""
        for layer in self.model.layers:
            if layer.self_attn.qkv_proj is None:
                layer.self_attn.fuse()
                layer.mlp.fuse()

    def set_kv_scales(self, scales: KVScales) -> None:
        """The per-layer K/V scales an fp8 cache is written and read with (engine.kv_quant)."""
        if len(scales.k) != len(self.model.layers):
            raise ValueError(f"{len(scales.k)} KV scales for {len(self.model.layers)} layers")
        for layer, k, v in zip(self.model.layers, scales.k, scales.v, strict=True):
            layer.self_attn.k_scale, layer.self_attn.v_scale = k, v

    def use_cpu_decode_kernel(self) -> bool:
        """On the torch path, attend the decode rows with the C kernel where it builds here (float32 and bfloat16
        caches) and torch runs on at most MAX_THREADS threads (the kernel runs on one; at one and two threads it
        was the faster, beyond that torch's parallel gather + SDPA is kept); False, and the torch path, elsewhere."""
        from engine.cpu_kernels.paged_decode import DTYPES, MAX_THREADS, load
        dtype = self.model.embed_tokens.weight.dtype
        self.cpu_decode_kernel = (not self.kernels_enabled and dtype in DTYPES
                                  and torch.get_num_threads() <= MAX_THREADS and load() is not None)
        return self.cpu_decode_kernel

    def use_cpu_prefill_kernel(self) -> bool:
        """On the torch path, attend the prefill chunks with the AMX kernel where it runs here (bfloat16, head_dim a
        multiple of 32) and torch runs on at most MAX_THREADS threads (the kernel runs on one); False elsewhere."""
        from engine.cpu_kernels.paged_decode import MAX_THREADS
        from engine.cpu_kernels.prefill_attention import takes
        self.cpu_prefill_kernel = (not self.kernels_enabled and torch.get_num_threads() <= MAX_THREADS
                                   and takes(self.config.head_dim, self.model.embed_tokens.weight.dtype))
        return self.cpu_prefill_kernel

    def use_packed_linears(self) -> bool:
        """On the torch path without TP, run the projections and the LM head with oneDNN-packed weights where this
        CPU and dtype allow (engine.cpu_kernels.packed_linear: the same bits, a decode step's linears about twice as
        fast in bfloat16); after this no linear's `.weight` exists."""
        from engine.cpu_kernels.packed_linear import pack_linears, packs
        if self.kernels_enabled or self.tp is not None or not packs(self.model.embed_tokens.weight.dtype):
            return False
        self.fuse_projections()
        return pack_linears(self) > 0

    def use_cpu_elementwise(self) -> bool:
        """On the torch path without TP, in bfloat16: RMSNorms (with their residual adds), SiLU-and-mul, and RoPE with
        the KV store as one C pass each (engine.cpu_kernels.elementwise) where it builds here; False (torch's ops)
        elsewhere."""
        from engine.cpu_kernels.elementwise import load
        if self.kernels_enabled or self.tp is not None or self.model.embed_tokens.weight.dtype != torch.bfloat16 \
                or load() is None:
            return False
        self.fuse_projections()
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.cpu_fused = True
        return True

    def use_kernels(self) -> None:
        """Switch to the GPU path (after the weights are loaded): fused projections and Triton kernels."""
        self.fuse_projections()
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP, Fp8Linear)):
                module.use_kernels = True
        for layer in self.model.layers:  # FP8 linears take their activations quantized by the norm before them
            for norm, linear in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                                 (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
                norm.quantize_for = linear if isinstance(linear, Fp8Linear) else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> float32 logits [S, vocab] (with TP: gathered, the same on every rank)."""
        if self.tp is None:
            if not self.config.tie_word_embeddings:
                return self.lm_head(hidden).float()  # an nn.Linear, or packed (use_packed_linears)
            return nn.functional.linear(hidden, self.model.embed_tokens.weight).float()
        if self.config.tie_word_embeddings:
            local = nn.functional.linear(hidden, self.model.embed_tokens.weight)  # [S, ceil(V / N)]
        else:
            local = self.lm_head(hidden)  # an nn.Linear without bias, or an Fp8Linear
        return self.tp.all_gather_last(local)[:, : self.config.vocab_size].float().contiguous()
