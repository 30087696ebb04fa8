"""A worker pool's settings (`prefill:` and `decode:`): how many workers it starts with and may scale between, what
each worker reserves (GPUs, CPUs, custom Ray resources) and the engine settings its workers run (batch sizes, KV
cache, preemption, the GPU path's switches, tensor parallelism). ServeConfig (coordinator.config.serve_config)
holds one per pool and turns it into each worker's EngineConfig.

    decode: {workers: 2, max_workers: 4, num_gpus: 1, max_num_seqs: 256, tensor_parallel_size: 1}
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.config.scaling_config import MAX_POOL_WORKERS
from engine.lane_splits import split_table

GRAPH_CAPTURES = ("auto", "start", "deferred")  # EngineConfig.graph_capture, or "auto" (PoolConfig.graph_capture)


@dataclass(frozen=True)
class PoolConfig:
    workers: int = 1              # the starting size (and, unless min_workers/max_workers differ, the only one)
    # the sizes the scaler may take the pool to (coordinator.backend.scaler); null: `workers` (no scaling)
    min_workers: int | None = None
    max_workers: int | None = None
    num_gpus: float = 0       # per worker; > 0 puts its engine on CUDA
    num_cpus: float = 1       # per worker
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunk_size: int | None = None          # most prompt tokens of one request per step
    head_bypass_steps: int = 128   # steps a waiting request short of KV blocks may be passed in the engine's queue
    # a request preempted for lack of KV blocks: "recompute", "swap" its KV to host memory and back, or "auto" (swap
    # when the copy is cheaper); swap_space_bytes of host memory per worker for swap and auto (EngineConfig)
    preemption_mode: str = "recompute"
    swap_space_bytes: int = 4 << 30
    # the host tier under each worker's prefix cache (engine.core.host_tier): bytes of host memory per worker (pinned
    # on a GPU); null: a share of the host's available memory; 0: off (EngineConfig.kv_host_cache_bytes)
    kv_host_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kernels: str = "auto"          # the engine's GPU path switches (EngineConfig): Triton kernels, CUDA graphs and
    cuda_graphs: bool = True       # overlapped scheduling; the defaults are the fast path, turn one off to compare
    async_scheduling: bool | None = None  # or to rule it out (None: on for GPU engines, off on the CPU)
    prefill_graph_tokens: int = 512  # with cuda_graphs: prefill-only steps up to this many tokens replay graphs too
    mixed_graph_tokens: int = 2048   # with cuda_graphs: steps with prompt chunks up to this many tokens, piecewise
    warmup: bool = True            # compile every Triton kernel variant before the worker reports ready (GPU)
    # "auto": "deferred" at tensor_parallel_size 1 (the first decode graphs at start, the rest while serving: a worker
    # ready seconds sooner), else "start" (EngineConfig.graph_capture)
    graph_capture: str = "auto"
    # > 0: prompts run beside the decode steps on the GPU's other SMs, the decode steps on this many (issue 43;
    # EngineConfig.sm_split_decode_sms), or a table {decode rows up to: SMs} (engine.lane_splits); 0: chunked
    # prefill only
    sm_split_decode_sms: int | dict[int, int] | tuple[tuple[int, int], ...] = 0
    tensor_parallel_size: int = 1  # ranks per worker (engine.model.parallel); a worker reserves num_gpus per rank
    kv_cache_dtype: str | None = None  # None: the top-level kv_cache_dtype (both pools must hold the same)
    # per worker, Ray custom resources ({"prefill_node": 1}) that only some nodes offer: puts the pool on them
    resources: dict[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.sm_split_decode_sms, int):  # frozen (and hashable): the table as sorted pairs
            try:
                object.__setattr__(self, "sm_split_decode_sms", split_table(self.sm_split_decode_sms))
            except ValueError as e:
                raise ValueError(f"sm_split_decode_sms: {e}, got {self.sm_split_decode_sms!r}") from None
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.min_workers is not None and not 1 <= self.min_workers <= self.workers:
            raise ValueError(f"min_workers must be in [1, workers ({self.workers})], got {self.min_workers}")
        if self.max_workers is not None and not self.workers <= self.max_workers <= MAX_POOL_WORKERS:
            raise ValueError(f"max_workers must be in [workers ({self.workers}), {MAX_POOL_WORKERS}], got "
                             f"{self.max_workers}")
        if self.graph_capture not in GRAPH_CAPTURES or (self.graph_capture == "deferred"
                                                        and self.tensor_parallel_size > 1):
            raise ValueError(f"graph_capture must be one of {GRAPH_CAPTURES} ('deferred' needs tensor_parallel_size "
                             f"1), got {self.graph_capture!r}")
        if self.tensor_parallel_size > 1 and self.num_gpus and self.num_gpus != int(self.num_gpus):
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} needs whole GPUs per rank "
                             f"(num_gpus), got {self.num_gpus}")

    @property
    def engine_graph_capture(self) -> str:
        """EngineConfig.graph_capture for this pool's engines ("auto" resolved)."""
        if self.graph_capture != "auto":
            return self.graph_capture
        return "deferred" if self.tensor_parallel_size == 1 else "start"

    @property
    def fewest(self) -> int:
        """The fewest workers the scaler leaves in the pool."""
        return self.workers if self.min_workers is None else self.min_workers

    @property
    def most(self) -> int:
        """The most workers the scaler grows the pool to."""
        return self.workers if self.max_workers is None else self.max_workers

    @property
    def scales(self) -> bool:
        return self.fewest < self.most

