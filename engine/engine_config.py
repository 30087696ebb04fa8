"""EngineConfig: the engine's own settings (not the model's), validated once and frozen."""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_quant import KV_CACHE_DTYPES
from engine.lane_splits import split_table

DTYPES = ("auto", "float32", "bfloat16", "float16")
KERNELS = ("auto", "triton", "torch")
LOAD_FORMATS = ("auto", "dummy")
TP_ALL_REDUCES = ("auto", "nccl", "one_shot")
PREEMPTION_MODES = ("recompute", "swap", "auto")  # engine.core.swap_space
GRAPH_CAPTURES = ("start", "deferred")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"                 # "tiny" or a local Hugging Face checkpoint folder
    dtype: str = "auto"                 # "auto" = the checkpoint's torch_dtype
    # what the KV cache stores: "auto" = `dtype`; "fp8" (= "fp8_e4m3"): float8 e4m3 with per-layer K/V scales from
    # the checkpoint or 1.0 (engine.kv_quant): twice the tokens per byte, half the bytes per KV handoff
    kv_cache_dtype: str = "auto"
    device: str = "cpu"                 # "cpu", "cuda", "cuda:1", ...
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget; longer prompts are prefilled in chunks
    max_prefill_chunk: int | None = None  # most prompt tokens of one request per step (None = the budget)
    # a step that also decodes carries only as many prompt tokens as keep it under this many seconds, measured on
    # this engine's own steps (engine.core.step_budget: running streams keep a time-per-token target while prompts
    # are prefilled beside them); None: the token budget alone
    decode_step_target_s: float | None = None
    enable_prefix_caching: bool = True
    # steps a waiting request short of KV blocks may be passed by ones of its priority behind it that fit; then what
    # frees is kept for it (engine.core.waiting: no head-of-line blocking, no starvation; 0: strict head of line)
    head_bypass_steps: int = 128
    # a request preempted for lack of KV blocks: "recompute" its KV when it resumes; "swap" its blocks to host memory
    # and back (recompute when the swap space is full); "auto": swap when the copy is cheaper than the recompute,
    # by the copy bandwidth measured at start and the engine's own prompt steps (engine.core.swap_space).
    # swap and auto: tensor_parallel_size 1
    preemption_mode: str = "recompute"
    swap_space_bytes: int = 4 << 30     # host memory for swapped-out KV (swap, auto); pinned on CUDA
    # the host tier under the prefix cache (engine.core.host_tier): bytes of host memory (pinned on CUDA) that keep
    # full blocks evicted from the device, copied back for a later prompt instead of recomputed. None: a share of the
    # host's available memory (engine.runner.host_tier_store.auto_host_cache_bytes); 0: none. Needs prefix caching
    # and tensor_parallel_size 1 (None turns it off elsewhere)
    kv_host_cache_bytes: int | None = None
    max_model_len: int | None = None    # None = the model's max_position_embeddings
    num_kv_blocks: int | None = None    # None = sized from kv_cache_memory_bytes / gpu_memory_utilization
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    pin_lease_s: float = 60.0           # prefill-only blocks are freed if not released within this time
    seed: int = 0                       # for requests without a seed of their own
    # "auto": Triton kernels on CUDA; on the CPU the torch path with the C decode-attention kernel where a C compiler
    # builds it (engine.cpu_kernels); or "triton", or "torch" (the plain reference everywhere)
    kernels: str = "auto"
    cuda_graphs: bool = True            # capture decode steps as CUDA graphs (with Triton kernels on CUDA)
    prefill_graph_tokens: int = 512     # with cuda_graphs, prefill-only steps up to this many tokens too (0: none)
    # with cuda_graphs, steps with prompt chunks (mixed or prefill-only) up to this many tokens (within
    # max_num_batched_tokens) replay piecewise graphs around eager attention (engine.runner.mixed_graphs; 0: none;
    # under tensor parallelism the pieces hold the all-reduces)
    mixed_graph_tokens: int = 2048
    # when the graphs are captured: "start" all of them before the engine is ready; "deferred" only the decode
    # buckets up to 8 rows, the rest once serving (a larger decode bucket when a step first needs it, the others
    # between steps: engine.runner.deferred_graphs), so the engine is ready seconds sooner. "deferred" needs
    # tensor_parallel_size 1 (every rank must capture alike); a pool's "auto" picks it there (PoolConfig)
    graph_capture: str = "start"
    # queue step N+1 before reading step N's tokens (see LLMEngine); None: on a CUDA engine, off on the CPU, where a
    # step computes inside its launch and overlap would only hand each step's tokens out one step later
    async_scheduling: bool | None = None
    # issue 43: > 0 runs a step's prompt chunks beside its decode rows instead of inside them: the prompt's forward
    # on a lane of the GPU's other SMs (green contexts, engine.runner.sm_lanes), the decode steps on a lane of this
    # many SMs with CUDA graphs of their own, until the prompt is done (engine.runner.prefill_lane). Or a table
    # {decode rows up to: SMs} (a dict, kept as sorted pairs): the split by the decode batch a job starts beside
    # (engine.lane_splits). Needs CUDA compute capability 9.0+, cuda-bindings, tensor_parallel_size 1; on the CPU the
    # lane runs in order (no split). 0: off (chunked prefill only)
    sm_split_decode_sms: int | tuple[tuple[int, int], ...] = 0
    warmup: bool = True                 # with Triton kernels: compile every kernel variant at start (runner.warmup)
    tensor_parallel_size: int = 1       # ranks the model is split over (engine.model.parallel; 1 = one device)
    device_ids: tuple[int, ...] | None = None  # CUDA device of each rank (None: consecutive from `device`)
    load_format: str = "auto"           # "auto": the checkpoint's safetensors; "dummy": random weights, no files
    # CUDA TP sums <= 1 MiB: "nccl"; "auto" by the one-shot kernel where every rank can set it up (else NCCL,
    # logged); "one_shot" (required). Larger sums and gloo (CPU) always by the process group. Not the default:
    # after a one-shot engine, a further TP engine in the process hung (engine.model.symmetric_all_reduce)
    tp_all_reduce: str = "nccl"

    def __post_init__(self) -> None:
        split_why = _split_error(self.sm_split_decode_sms)
        if split_why is None and not isinstance(self.sm_split_decode_sms, int):  # frozen: the table in its one form
            object.__setattr__(self, "sm_split_decode_sms", split_table(self.sm_split_decode_sms))
        checks = [
            ("dtype", self.dtype in DTYPES, f"must be one of {DTYPES}"),
            ("kv_cache_dtype", self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"must be one of {KV_CACHE_DTYPES} ('auto': the model's dtype; 'fp8' = 'fp8_e4m3')"),
            ("block_size", self.block_size > 0, "must be positive"),
            ("max_num_seqs", self.max_num_seqs > 0, "must be positive"),
            ("max_num_batched_tokens", self.max_num_batched_tokens > 0, "must be positive"),
            ("prefill_graph_tokens", isinstance(self.prefill_graph_tokens, int)
             and not isinstance(self.prefill_graph_tokens, bool) and self.prefill_graph_tokens >= 0,
             "must be an integer >= 0"),
            ("async_scheduling", self.async_scheduling in (None, True, False), "must be a bool or None"),
            ("mixed_graph_tokens", isinstance(self.mixed_graph_tokens, int)
             and not isinstance(self.mixed_graph_tokens, bool) and self.mixed_graph_tokens >= 0,
             "must be an integer >= 0"),
            ("graph_capture", self.graph_capture in GRAPH_CAPTURES and (
                self.graph_capture != "deferred" or self.tensor_parallel_size == 1),
             f"must be one of {GRAPH_CAPTURES} ('deferred' needs tensor_parallel_size 1)"),
            ("head_bypass_steps", isinstance(self.head_bypass_steps, int)
             and not isinstance(self.head_bypass_steps, bool) and self.head_bypass_steps >= 0,
             "must be an integer >= 0"),
            ("preemption_mode", self.preemption_mode in PREEMPTION_MODES and (
                self.preemption_mode == "recompute" or self.tensor_parallel_size == 1),
             f"must be one of {PREEMPTION_MODES} ('swap' and 'auto' need tensor_parallel_size 1)"),
            ("swap_space_bytes", isinstance(self.swap_space_bytes, int) and not isinstance(self.swap_space_bytes, bool)
             and self.swap_space_bytes > 0, "must be a positive integer (bytes)"),
            ("kv_host_cache_bytes", self.kv_host_cache_bytes is None or (
                isinstance(self.kv_host_cache_bytes, int) and not isinstance(self.kv_host_cache_bytes, bool)
                and self.kv_host_cache_bytes >= 0 and (self.kv_host_cache_bytes == 0 or (
                    self.tensor_parallel_size == 1 and self.enable_prefix_caching))),
             "must be null (sized from the host's memory), 0 (off) or a number of bytes; a host tier needs "
             "enable_prefix_caching and tensor_parallel_size 1"),
            ("sm_split_decode_sms", split_why is None and (not split_table(self.sm_split_decode_sms)
                                                           or self.tensor_parallel_size == 1),
             split_why or "needs tensor_parallel_size 1 (a lane splits one device's SMs)"),
            ("max_prefill_chunk", self.max_prefill_chunk is None or self.max_prefill_chunk > 0, "must be positive"),
            ("decode_step_target_s", self.decode_step_target_s is None or (
                isinstance(self.decode_step_target_s, (int, float)) and not isinstance(self.decode_step_target_s, bool)
                and 0 < self.decode_step_target_s <= 60), "must be None or a number of seconds in (0, 60]"),
            ("max_model_len", self.max_model_len is None or self.max_model_len > 0, "must be positive"),
            ("num_kv_blocks", self.num_kv_blocks is None or self.num_kv_blocks > 0, "must be positive"),
            ("kv_cache_memory_bytes", self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
             "must be positive"),
            ("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "must be in (0, 1]"),
            ("pin_lease_s", self.pin_lease_s > 0, "must be positive"),
            ("kernels", self.kernels in KERNELS, f"must be one of {KERNELS}"),
            ("tensor_parallel_size", isinstance(self.tensor_parallel_size, int)
             and not isinstance(self.tensor_parallel_size, bool) and self.tensor_parallel_size >= 1,
             "must be an integer >= 1"),
            ("device_ids", self.device_ids is None or (
                self.device.startswith("cuda") and len(self.device_ids) == self.tensor_parallel_size
                and len(set(self.device_ids)) == len(self.device_ids)),
             "must name tensor_parallel_size distinct CUDA devices (with a cuda device)"),
            ("load_format", self.load_format in LOAD_FORMATS, f"must be one of {LOAD_FORMATS}"),
            ("tp_all_reduce", self.tp_all_reduce in TP_ALL_REDUCES and (
                self.tp_all_reduce != "one_shot" or self.device.startswith("cuda")),
             f"must be one of {TP_ALL_REDUCES} ('one_shot' needs a cuda device)"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"EngineConfig.{name} {why}, got {getattr(self, name)!r}")


def _split_error(value: object) -> str | None:
    """Why `value` is no sm_split_decode_sms (engine.lane_splits), None if it is one."""
    try:
        split_table(value)
    except ValueError as e:
        return str(e)
    return None
