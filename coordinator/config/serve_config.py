"""ServeConfig: one validated, frozen config tree loaded once from `configs/<name>.yaml`.

Each part goes only where it belongs: EngineConfig to each worker of a pool, AgentConfig to the transfer
agents, ServerSettings to the HTTP app. Unknown keys and bad values fail at load with the file, key and reason.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from coordinator.config.adaptive_config import PlannerConfig, SLOConfig
from coordinator.config.scaling_config import MAX_POOL_WORKERS, ScalingConfig
from coordinator.config.settings import ServerSettings
from coordinator.config.straggler_config import StragglerConfig
from coordinator.config.tenants_config import TenantsConfig, parse_tenants
from engine.config_error import ConfigError
from engine.engine_config import EngineConfig


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
    tensor_parallel_size: int = 1  # ranks per worker (engine.model.parallel); a worker reserves num_gpus per rank
    kv_cache_dtype: str | None = None  # None: the top-level kv_cache_dtype (both pools must hold the same)
    # per worker, Ray custom resources ({"prefill_node": 1}) that only some nodes offer: puts the pool on them
    resources: dict[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.min_workers is not None and not 1 <= self.min_workers <= self.workers:
            raise ValueError(f"min_workers must be in [1, workers ({self.workers})], got {self.min_workers}")
        if self.max_workers is not None and not self.workers <= self.max_workers <= MAX_POOL_WORKERS:
            raise ValueError(f"max_workers must be in [workers ({self.workers}), {MAX_POOL_WORKERS}], got "
                             f"{self.max_workers}")
        if self.tensor_parallel_size > 1 and self.num_gpus and self.num_gpus != int(self.num_gpus):
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} needs whole GPUs per rank "
                             f"(num_gpus), got {self.num_gpus}")

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


NET_DEVICES = re.compile(r"[A-Za-z0-9_.:-]{1,32}(,[A-Za-z0-9_.:-]{1,32}){0,15}")  # UCX_NET_DEVICES' form


@dataclass(frozen=True)
class TransferConfig:
    backends: tuple[str, ...] = ("cuda_ipc", "ucx")
    timeout_s: float = 30.0
    pin_lease_s: float = 60.0
    on_failure: str = "recompute"  # a failed KV transfer: the decode worker recomputes the prompt, or the request fails
    # the prefill worker writes each prompt's KV into the blocks its decode worker booked, layer group by layer
    # group during the forward (prefill_pool.kv_push), so decode only joins; false: decode pulls it after the prefill.
    # Pools of tensor_parallel_size 1 only (larger ones pull)
    push: bool = True
    # the network devices UCX carries KV over and listens on (UCX_NET_DEVICES: "eth1", "mlx5_0:1,eth1"), set in
    # every worker; null: the workers' environment decides (a single-host server's is "lo": ray_network)
    net_devices: str | None = None

    def __post_init__(self) -> None:
        if self.net_devices is not None and not NET_DEVICES.fullmatch(self.net_devices):
            raise ValueError(f"net_devices must name network devices as UCX_NET_DEVICES does (\"eth1\", "
                             f"\"mlx5_0:1,eth1\"), got {self.net_devices[:64]!r}")


@dataclass(frozen=True)
class AdmissionConfig:
    max_queue: int = 1024          # requests in flight beyond which new ones get 503
    timeout_s: float = 30.0        # how long a request may wait for room (or for a replacement worker)
    # null (growing bookings): a decode worker books the prompt and reserve_ahead_tokens of output, and the booking
    # grows as the request decodes (coordinator.admission.growth; the engine preempts when blocks run out). A number:
    # that fraction of max_tokens booked up front and never grown; 1.0 never oversubscribes (no preemption)
    reserve_output: float | None = None
    reserve_ahead_tokens: int = 64  # growing bookings: output tokens booked beyond those a request has generated
    max_prefill_backlog_tokens: int | None = None  # per prefill worker: prompt tokens booked and not yet prefilled
    priority_aging_s: float = 10.0  # a waiting request moves up one priority class per this many seconds
    reserved_for_high: float = 0.0  # share of each worker's KV and prefill backlog only high-priority requests book
    # a waiting request that does not fit may be passed by ones behind it that do for this long after it arrived;
    # then what frees is kept for it (no head-of-line blocking, no starvation; 0: strict head of line)
    bypass_s: float = 5.0

    def __post_init__(self) -> None:
        if self.reserve_output is not None and not 0 < self.reserve_output <= 1:
            raise ValueError(f"reserve_output must be null (growing bookings) or in (0, 1], got {self.reserve_output}")
        if isinstance(self.reserve_ahead_tokens, bool) or not isinstance(self.reserve_ahead_tokens, int) \
                or self.reserve_ahead_tokens < 1:
            raise ValueError(f"reserve_ahead_tokens must be an integer >= 1, got {self.reserve_ahead_tokens!r}")
        if self.max_prefill_backlog_tokens is not None and self.max_prefill_backlog_tokens < 1:
            raise ValueError(f"max_prefill_backlog_tokens must be >= 1, got {self.max_prefill_backlog_tokens}")
        if not 0 <= self.reserved_for_high < 1:
            raise ValueError(f"reserved_for_high must be in [0, 1), got {self.reserved_for_high}")
        if not self.priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0, got {self.priority_aging_s}")
        if not 0 <= self.bypass_s <= 3600:
            raise ValueError(f"bypass_s must be in [0, 3600], got {self.bypass_s}")


MAX_SPARES = 64


@dataclass(frozen=True)
class RecoveryConfig:
    """Self-healing: replacing dead workers (with backoff) and moving their requests elsewhere."""

    max_restarts: int = 5            # per worker slot within restart_window_s; past it the slot stays down
    restart_window_s: float = 600.0
    backoff_initial_s: float = 0.5   # wait before the first replacement of a slot; doubles per recent restart
    backoff_max_s: float = 30.0
    max_migrations: int = 3          # per request: moves to another worker after a worker or transfer failure
    # disaggregated: while one pool has no live worker, requests (new and moved) run whole on the other pool's workers
    fallback: bool = True
    spares: int = 0                  # warm spare workers per pool (model loaded, not routed to); take over a dead slot
    # coordinator crashes `pdserve serve` restarts it after within restart_window_s (with the backoff above); it
    # adopts the running workers (coordinator.process_supervisor). 0: a crashed coordinator ends the server
    coordinator_max_restarts: int = 5

    def __post_init__(self) -> None:
        if not 0 <= self.spares <= MAX_SPARES:
            raise ValueError(f"spares must be in [0, {MAX_SPARES}] (warm spare workers per pool), got {self.spares}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(f"backoff_max_s ({self.backoff_max_s}) must be >= backoff_initial_s "
                             f"({self.backoff_initial_s})")


MAX_STALL_S = 600.0  # an injected transfer stall longer than a request's default timeout tests nothing more
MAX_SLOW_STEP_S = 10.0  # an injected step sleep: slower than this is a hung worker (the liveness probe's to find)


@dataclass(frozen=True)
class FaultsConfig:
    """Failures injected on purpose, for tests and operators' drills (also settable at run time through
    POST /admin/faults when server.admin_api is on). All off by default."""

    prefill_error_fraction: float = 0.0   # prefill calls that fail with an injected error
    transfer_fail_fraction: float = 0.0   # KV transfers that fail (the decode side then recomputes or fails)
    transfer_stall_fraction: float = 0.0  # KV transfers held back for transfer_stall_s before they proceed
    transfer_stall_s: float = 0.0
    seed: int = 0
    # a throttled worker: each engine step of the workers named (none named: every worker) sleeps this long; only the
    # processes live when it is set (a replacement is a fresh process, as a straggler's is: it is not slowed)
    slow_step_s: float = 0.0
    slow_workers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        slow = self.slow_step_s
        if isinstance(slow, bool) or not isinstance(slow, int | float) or not 0 <= slow <= MAX_SLOW_STEP_S:
            raise ValueError(f"slow_step_s must be a number in [0, {MAX_SLOW_STEP_S:g}], got {slow!r}")
        names = self.slow_workers
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"slow_workers must be a list of worker names, got {names!r}")
        object.__setattr__(self, "slow_workers", tuple(names))  # a JSON list (POST /admin/faults) too
        for name in ("prefill_error_fraction", "transfer_fail_fraction", "transfer_stall_fraction"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
        stall = self.transfer_stall_s
        if isinstance(stall, bool) or not isinstance(stall, int | float) or not 0 <= stall <= MAX_STALL_S:
            raise ValueError(f"transfer_stall_s must be a number in [0, {MAX_STALL_S:g}], got {stall!r}")
        seed = self.seed  # the workers' fault RNGs take an integer: NaN, inf, a string or a bool is refused here
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r:.40}")


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
            warmup=pool.warmup,
            tensor_parallel_size=pool.tensor_parallel_size, load_format=self.load_format,
            decode_step_target_s=self.slo.decode_step_target_s if self.adaptive and self.slo else None)


_SECTIONS = {"prefill": PoolConfig, "decode": PoolConfig, "transfer": TransferConfig,
             "admission": AdmissionConfig, "recovery": RecoveryConfig, "faults": FaultsConfig,
             "stragglers": StragglerConfig,
             "server": ServerSettings, "slo": SLOConfig, "planner": PlannerConfig, "scaling": ScalingConfig}
_CHOICES = {"mode": ("disaggregated", "collocated", "adaptive"), "placement": ("pack", "spread"),
            "on_failure": ("recompute", "fail")}


def set_dotted(raw: dict, overrides: dict[str, Any]) -> dict:
    """Set each {"server.port": 8001, ...} override in a raw (YAML) config mapping, in place; returned."""
    for dotted, value in overrides.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return raw


def load_serve_config(path: str | Path, overrides: dict[str, Any] | None = None) -> ServeConfig:
    """Read and validate a YAML file; `overrides` ({"server.port": 8001, ...}) win over the file."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    set_dotted(raw, overrides or {})
    tenants = parse_tenants(raw.pop("tenants", None), path)
    config = replace(_build(ServeConfig, raw, path, ""), tenants=tenants)
    if any(config.server.admin_api_key in t.api_keys for t in tenants.tenants):
        raise ConfigError(f"{path}: server.admin_api_key is also a tenant's key: the operator's key must be its own")
    if any(config.server.metrics_api_key in t.api_keys for t in tenants.tenants):
        raise ConfigError(f"{path}: server.metrics_api_key is also a tenant's key: the metrics key must be its own")
    if tenants.tenants and config.server.api_key is not None:
        raise ConfigError(f"{path}: server.api_key and tenants are exclusive: with tenants, their api_keys are the "
                          "server's keys (move the key to a tenant)")
    for pool in ("prefill", "decode"):  # the engine's own checks, now rather than inside a worker
        try:
            config.engine_config(getattr(config, pool))
        except ValueError as e:
            raise ConfigError(f"{path}: {pool} workers' engine: {e}") from None
    _check_scaling(config, raw, path)
    _check_adaptive(config, raw, path)
    _check_kv_cache_dtype(config, path)
    return config


def _check_kv_cache_dtype(config: ServeConfig, path: Path) -> None:
    """KV blocks move between the pools byte for byte: both pools must store the same KV cache dtype."""
    prefill, decode = config.kv_cache_dtype_of(config.prefill), config.kv_cache_dtype_of(config.decode)
    if config.mode != "collocated" and _fp8(prefill) != _fp8(decode):
        raise ConfigError(f"{path}: prefill.kv_cache_dtype {prefill!r} and decode.kv_cache_dtype {decode!r} disagree: "
                          "the KV cache moves between the pools as it is stored, so both must hold the same dtype "
                          "(set kv_cache_dtype once at the top level)")


def _fp8(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype != "auto"  # "fp8" and "fp8_e4m3" name the same cache


def _check_adaptive(config: ServeConfig, raw: dict, path: Path) -> None:
    """`slo` and `planner` belong to mode adaptive, which needs `slo` (`slo` also serves pools that scale:
    _check_scaling); its workers can each take the other's role."""
    if not config.adaptive:
        extra = [key for key in ("slo", "planner") if key in raw and not (key == "slo" and config.scaling_pools)]
        if extra:
            raise ConfigError(f"{path}: {extra[0]!r} applies to mode: adaptive only (mode is {config.mode!r})"
                              + (" or to pools that scale (min_workers / max_workers)" if extra[0] == "slo" else ""))
        return
    if config.slo is None:
        raise ConfigError(f"{path}: mode adaptive needs 'slo' with ttft_ms and tpot_ms (the targets it serves)")
    if config.prefill.tensor_parallel_size != config.decode.tensor_parallel_size \
            or config.prefill.num_gpus != config.decode.num_gpus:
        raise ConfigError(f"{path}: mode adaptive: a worker may take either role, so prefill and decode need the same "
                          "tensor_parallel_size and num_gpus")


def _check_scaling(config: ServeConfig, raw: dict, path: Path) -> None:
    """Pools that scale need the targets they are grown for (`slo`); `scaling` and a pool's min_workers /
    max_workers apply only where they are read."""
    if config.mode == "collocated":
        pool = config.prefill
        for key in ("min_workers", "max_workers"):
            if getattr(pool, key) not in (None, pool.workers):
                raise ConfigError(f"{path}: 'prefill.{key}': mode collocated runs the decode pool only (scale it "
                                  "with decode.min_workers / decode.max_workers)")
    if not config.scaling_pools:
        if "scaling" in raw:
            raise ConfigError(f"{path}: 'scaling' applies only to a pool whose min_workers or max_workers differs "
                              "from its workers (no pool here scales)")
        return
    if config.slo is None:
        pool = config.scaling_pools[0]
        raise ConfigError(f"{path}: pool {pool!r} scales ({pool}.min_workers {getattr(config, pool).fewest}, "
                          f"{pool}.max_workers {getattr(config, pool).most}): it needs 'slo' with ttft_ms and tpot_ms "
                          "(the targets a pool is grown for)")


def check_tensor_parallel(config: ServeConfig, path: Path | str) -> None:
    """ConfigError naming the key when a pool's tensor_parallel_size cannot split the model in `config.model`
    (checked where its config.json is on disk, before any worker starts; elsewhere the workers report it)."""
    from engine.model.model_config import ModelConfig
    from engine.model.tp_layout import FIELD, TPLayout
    folder = Path(config.model)
    if not (folder / "config.json").is_file():
        return
    model = ModelConfig.from_folder(folder)
    for pool in (("prefill", "decode") if config.mode == "disaggregated" else ("decode",)):
        try:
            TPLayout.check(model, getattr(config, pool).tensor_parallel_size)
        except ValueError as e:
            raise ConfigError(f"{path}: {str(e).replace(FIELD, f'{pool}.tensor_parallel_size')} "
                              f"({folder}/config.json)") from None


def _build(cls: type, raw: dict, path: Path, prefix: str) -> Any:
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"{path}: unknown key {prefix + unknown[0]!r}; known keys here: {sorted(known)}")
    values = {}
    for name, value in raw.items():
        key = f"{prefix}{name}"
        if name in _SECTIONS and cls is ServeConfig:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: {key!r} must be a mapping, got {value!r}")
            value = _build(_SECTIONS[name], value, path, f"{key}.")
        elif name in _CHOICES and value not in _CHOICES[name]:
            raise ConfigError(f"{path}: {key!r} must be one of {_CHOICES[name]}, got {value!r}")
        elif name in ("backends", "slow_workers"):
            value = tuple([value] if isinstance(value, str) else value)
        elif name == "resources" and cls is PoolConfig:
            _check_resources(value, path, key)
        values[name] = _check_type(value, known[name], path, key)
    missing = [name for name, f in known.items() if name not in values and f.default is MISSING
               and f.default_factory is MISSING]
    if missing:
        raise ConfigError(f"{path}: {prefix + missing[0]!r} is required (it has no default)")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {prefix.rstrip('.') or 'top level'}: {e}") from None


def _check_type(value: Any, field: Any, path: Path, key: str) -> Any:
    expected = str(field.type)
    if value is None:
        if "None" in expected:
            return None
        raise ConfigError(f"{path}: {key!r} may not be null")
    if isinstance(value, bool) and "bool" not in expected:
        raise ConfigError(f"{path}: {key!r} must be {expected}, got {value!r}")
    checks = [("dict", (dict,)), ("bool", (bool,)), ("int", (int,)), ("float", (int, float)), ("str", (str,)),
              ("tuple", (tuple,))]
    for name, types in checks:
        if expected.startswith(name) or f"{name} |" in expected or f"| {name}" in expected:
            if isinstance(value, types):
                if name in ("int", "float") and value < 0:
                    raise ConfigError(f"{path}: {key!r} must not be negative, got {value!r}")
                return value
    if not any(name in expected for name, _ in checks):  # nested section objects were built already
        return value
    raise ConfigError(f"{path}: {key!r} must be {expected}, got {type(value).__name__} {value!r}")


_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def _check_resources(value: Any, path: Path, key: str) -> None:
    """A pool's custom Ray resources: {name: amount per worker}, amounts Ray can place (a fraction or whole)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {key!r} must be a mapping of resource name to amount, got {value!r}")
    for name, amount in value.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{path}: {key!r}: resource names must be non-empty strings, got {name!r}")
        if name in _BUILTIN_RESOURCES:
            raise ConfigError(f"{path}: {key}.{name}: set CPUs and GPUs with num_cpus / num_gpus, not resources")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
            raise ConfigError(f"{path}: {key}.{name} must be a positive number, got {amount!r}")
        if amount > 1 and amount != int(amount):
            raise ConfigError(f"{path}: {key}.{name}: Ray takes amounts above 1 only whole, got {amount!r}")
