"""ServeConfig: the whole validated configuration, frozen: its top-level keys and one dataclass per section (each
section's in a module of its own). Built by coordinator.config.serve_config's loader; read by everything that
serves. It hands each part to where it belongs: EngineConfig to each worker of a pool (`engine_config`)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.config.adaptive_config import PlannerConfig, SLOConfig
from coordinator.config.admission_config import AdmissionConfig
from coordinator.config.faults_config import FaultsConfig
from coordinator.config.pool_config import PoolConfig
from coordinator.config.recovery_config import RecoveryConfig
from coordinator.config.scaling_config import ScalingConfig
from coordinator.config.settings import ServerSettings
from coordinator.config.straggler_config import StragglerConfig
from coordinator.config.tenants_config import TenantsConfig
from coordinator.config.transfer_config import TransferConfig
from engine.engine_config import EngineConfig


@dataclass(frozen=True)
class ServeConfig:
    model: str = "tiny"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"   # "auto": dtype's; "fp8" / "fp8_e4m3": float8 KV cache (engine.kv_quant)
    load_format: str = "auto"      # "auto": the checkpoint's weights; "dummy": random ones (benchmarks of big shapes)
    block_size: int = 16
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # "disaggregated" (prefill and decode pools), "collocated" (every worker runs whole requests) or "adaptive"
    # (the pools' sizes are the starting split; per request placement and the planner choose while serving)
    mode: str = "disaggregated"
    placement: str = "pack"        # "pack" | "spread"
    ray_address: str | None = None  # None: start a local Ray; "auto": join the running cluster
    # the Ray namespace of the server's workers, which outlive a crashed coordinator there (coordinator.backend.fleet);
    # None: `pdserve serve` derives one from the host name and port (pdserve-HOST-PORT)
    namespace: str | None = None
    prefill: PoolConfig = PoolConfig()
    decode: PoolConfig = PoolConfig(max_num_seqs=256)
    transfer: TransferConfig = TransferConfig()
    admission: AdmissionConfig = AdmissionConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    faults: FaultsConfig = FaultsConfig()
    stragglers: StragglerConfig = StragglerConfig()  # workers much slower than their peers: found, replaced
    server: ServerSettings = ServerSettings()
    tenants: TenantsConfig = TenantsConfig()  # API keys -> tenants with rate limits and a priority class
    slo: SLOConfig | None = None    # mode adaptive: the targets placement and the planner serve (required there)
    planner: PlannerConfig = PlannerConfig()  # mode adaptive: how roles move
    scaling: ScalingConfig = ScalingConfig()  # pools that scale (min_workers / max_workers): when they grow, shrink

    @property
    def adaptive(self) -> bool:
        return self.mode == "adaptive"

    @property
    def transfers(self) -> bool:
        """Workers hand KV over to each other (every mode but collocated): they run KV agents."""
        return self.mode != "collocated"

    @property
    def pool_names(self) -> tuple[str, ...]:
        """The pools the workers are started from (collocated: the decode pool alone)."""
        return ("decode",) if self.mode == "collocated" else ("prefill", "decode")

    @property
    def scaling_pools(self) -> tuple[str, ...]:
        """The pools whose size the scaler may change (coordinator.backend.scaler)."""
        return tuple(name for name in self.pool_names if getattr(self, name).scales)

    def kv_cache_dtype_of(self, pool: PoolConfig) -> str:
        """The kv_cache_dtype a pool's engines run: its own, else the top-level one."""
        return pool.kv_cache_dtype if pool.kv_cache_dtype is not None else self.kv_cache_dtype

    def engine_config(self, pool: PoolConfig, seed: int = 0) -> EngineConfig:
        return EngineConfig(
            model=self.model, dtype=self.dtype, device="cuda" if pool.num_gpus > 0 else "cpu",
            kv_cache_dtype=self.kv_cache_dtype_of(pool),
            block_size=self.block_size, max_num_seqs=pool.max_num_seqs,
            max_num_batched_tokens=pool.max_num_batched_tokens, max_prefill_chunk=pool.chunk_size,
            head_bypass_steps=pool.head_bypass_steps, preemption_mode=pool.preemption_mode,
            swap_space_bytes=pool.swap_space_bytes, kv_host_cache_bytes=pool.kv_host_cache_bytes,
            enable_prefix_caching=self.enable_prefix_caching, max_model_len=self.max_model_len,
            num_kv_blocks=pool.num_kv_blocks, kv_cache_memory_bytes=pool.kv_cache_memory_bytes,
            gpu_memory_utilization=pool.gpu_memory_utilization, pin_lease_s=self.transfer.pin_lease_s, seed=seed,
            kernels=pool.kernels, cuda_graphs=pool.cuda_graphs, async_scheduling=pool.async_scheduling,
            prefill_graph_tokens=pool.prefill_graph_tokens, mixed_graph_tokens=pool.mixed_graph_tokens,
            warmup=pool.warmup, graph_capture=pool.engine_graph_capture, sm_split_decode_sms=pool.sm_split_decode_sms,
            tensor_parallel_size=pool.tensor_parallel_size, load_format=self.load_format,
            decode_step_target_s=self.slo.decode_step_target_s if self.adaptive and self.slo else None)
