"""One rank's model, KV cache and CUDA graphs: the start-up every tensor-parallel rank runs alike (rank 0 inside
LLMEngine, the others in engine.runner.tp_follower), and the only start-up TP=1 runs.

Owns: building the model on the meta device and filling it (a checkpoint, only this rank's slices with TP, or
dummy weights; an FP8 checkpoint's linears as engine.model.fp8_linear.Fp8Linear), the rank's KVCacheSpec (its
local KV heads), sizing the cache from the memory budget, and the graphs. The number of blocks is agreed before
allocation (`agree`: with TP the minimum over the ranks), so every
rank's cache has the same blocks and one block table addresses all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.engine_config import EngineConfig
from engine.kv_heads import KVHeadRange
from engine.kv_layout import KVCacheSpec
from engine.kv_quant import FP8_DTYPE, load_kv_scales
from engine.load import PhaseClock
from engine.model.decoder import CausalLM
from engine.model.fp8_linear import finish_fp8, fp8_scale_slices, swap_in_fp8
from engine.model.model_config import ModelConfig
from engine.model.parallel import TPGroup
from engine.model.tp_layout import TPLayout
from engine.model.weights import init_dummy_weights, load_weights
from engine.runner.cuda_graphs import DecodeGraphs
from engine.runner.host_memory import keep_freed_memory
from engine.runner.kv_cache import TORCH_DTYPES, allocate_kv_cache, cache_spec
from engine.runner.mixed_graphs import MixedGraphs
from engine.runner.prefill_graphs import PrefillGraphs

CPU_KV_CACHE_BYTES = 1 << 30
# with deferred capture, the decode buckets captured at start: the batches a new worker meets first (a replacement
# takes over the running streams of the worker it replaces a few at a time); larger ones when first needed or idle
FIRST_DECODE_BUCKETS = 8
GPU_ACTIVATION_HEADROOM_BYTES = 2 << 30


@dataclass
class RankState:
    model: CausalLM
    uses_kernels: bool
    kv_spec: KVCacheSpec             # num_kv_heads: this rank's (local) KV heads
    kv_head_range: KVHeadRange       # the global KV heads this rank's cache holds
    num_kv_blocks: int
    kv_cache: torch.Tensor           # [NB, L, 2, bs, KVH local, D]
    graphs: DecodeGraphs | None
    prefill_graphs: PrefillGraphs | None
    mixed_graphs: MixedGraphs | None


def build_rank(mc: ModelConfig, path: Path, config: EngineConfig, device: torch.device, tp: TPGroup | None,
               agree: Callable[[int], int] = int, clock: PhaseClock | None = None) -> RankState:
    """`config` is resolved (dtype and max_model_len set). `agree(blocks this rank can hold)` -> blocks to use.
    `clock` laps "weights", "kv_cache", "cuda_graphs", "prefill_graphs" and "mixed_graphs" (with deferred capture
    the last two capture nothing: engine.runner.deferred_graphs captures the rest while serving)."""
    clock = clock or PhaseClock()
    model = _load_model(mc, path, config, device, tp)
    clock.lap("weights")
    uses_kernels = config.kernels == "triton" or (config.kernels == "auto" and device.type == "cuda")
    model.fuse_projections()
    if uses_kernels:
        model.use_kernels()
    elif config.kernels == "auto" and device.type == "cpu":
        model.use_cpu_decode_kernel()  # builds it now (about a second, once per machine), not on the first step
        model.use_cpu_prefill_kernel()
        model.use_packed_linears()
        model.use_cpu_elementwise()
    if device.type == "cpu":
        keep_freed_memory()  # each prefill step's large activations re-use heap pages instead of new mappings
    layout = TPLayout(mc, 0, 1) if tp is None else TPLayout(mc, tp.rank, tp.size)
    scales = load_kv_scales(None if config.load_format == "dummy" else path, mc.num_layers)
    spec = cache_spec(mc, layout.kv_heads, config, scales)
    if spec.dtype == FP8_DTYPE:
        model.set_kv_scales(scales)
    blocks = agree(_affordable_blocks(config, spec, device))
    if blocks < blocks_for(min(config.max_model_len, 2 * config.block_size), config.block_size):
        raise ValueError(f"KV cache budget holds only {blocks} blocks of {spec.block_bytes} bytes")
    kv_cache = allocate_kv_cache(spec, blocks, device)
    clock.lap("kv_cache")
    graphs = prefill_graphs = mixed_graphs = None
    if uses_kernels and config.cuda_graphs and device.type == "cuda":
        width = blocks_for(config.max_model_len, config.block_size)
        deferred = config.graph_capture == "deferred"
        torch.cuda.empty_cache()  # blocks cached for the load's temporaries: the graphs' own pool cannot use them
        graphs = DecodeGraphs(model, kv_cache, config.max_num_seqs, width,
                              first_buckets=FIRST_DECODE_BUCKETS if deferred else None)
        clock.lap("cuda_graphs")
        if prefill_graph_tokens(config):
            prefill_graphs = PrefillGraphs(model, kv_cache, prefill_graph_tokens(config), config.max_num_seqs, width,
                                           deferred=deferred)
            clock.lap("prefill_graphs")
        if mixed_graph_tokens(config):
            mixed_graphs = MixedGraphs(model, kv_cache, mixed_graph_tokens(config), deferred=deferred)
            clock.lap("mixed_graphs")
    return RankState(model, uses_kernels, spec, layout.kv_head_range, blocks, kv_cache, graphs, prefill_graphs,
                     mixed_graphs)


def prefill_graph_tokens(config: EngineConfig) -> int:
    """The largest prefill-only step replayed from a graph: the config's bound within the step budget."""
    return min(config.prefill_graph_tokens, config.max_num_batched_tokens)


def mixed_graph_tokens(config: EngineConfig) -> int:
    """The largest step with prompt chunks replayed piecewise: the config's bound within the step budget (under
    tensor parallelism the pieces hold the all-reduces, as the decode graphs do)."""
    return min(config.mixed_graph_tokens, config.max_num_batched_tokens)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _load_model(mc: ModelConfig, path: Path, config: EngineConfig, device: torch.device,
                tp: TPGroup | None) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(mc, config.max_model_len, tp)
    # the dtype first, on the meta device: _allocate() then allocates the weights once, in their own dtype (a
    # float32 allocation converted afterwards would need twice the memory: a 70B shard would not fit an 80 GB GPU)
    dtype = TORCH_DTYPES[config.dtype]
    model = model.to(dtype)
    if mc.fp8 is not None:  # after the dtype conversion, which would upcast FP8 weights
        swap_in_fp8(model, mc.fp8, dtype)  # any dtype: the kernel path's FP8 GEMMs write each (fp8_linear)
    model = _allocate(model, device)
    model.rope.build(device)  # float32 tables, not converted
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        slices = None if tp is None else fp8_scale_slices(TPLayout(mc, tp.rank, tp.size).slices(), mc.fp8)
        load_weights(model, path, slices)
    finish_fp8(model)
    return model.eval()


def _allocate(model: CausalLM, device: torch.device) -> CausalLM:
    """Module.to_empty without its `empty_like`: on a meta tensor that runs torch's Python reference, which imports
    sympy (torch.fx.experimental.symbolic_shapes): 2.2 s of a worker's start on an H200 host, 0.2 s on the CPU
    machine. torch.empty from the shape and dtype allocates the same uninitialised tensor."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def _affordable_blocks(cfg: EngineConfig, spec: KVCacheSpec, device: torch.device) -> int:
    """Blocks this rank's budget holds: num_kv_blocks, kv_cache_memory_bytes, or the free device memory."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    if cfg.kv_cache_memory_bytes is not None:
        budget = cfg.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * cfg.gpu_memory_utilization) - (total - free) - GPU_ACTIVATION_HEADROOM_BYTES
    else:
        enough = cfg.max_num_seqs * blocks_for(cfg.max_model_len, cfg.block_size) * spec.block_bytes
        budget = min(CPU_KV_CACHE_BYTES, enough)
    return max(0, budget // spec.block_bytes)
