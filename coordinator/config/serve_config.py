"""ServeConfig: one validated, frozen config tree loaded once from `configs/<name>.yaml`.

Each part goes only where it belongs: EngineConfig to each worker of a pool, AgentConfig to the transfer
agents, ServerSettings to the HTTP app. Unknown keys and bad values fail at load with the file, key and reason.

This module owns the loader (load_serve_config: YAML to the tree, each key's type checked); the tree's top level
(ServeConfig) is in config_tree, each section's dataclass in a module of its own (pool_config, transfer_config,
admission_config, recovery_config, faults_config, straggler_config, scaling_config, adaptive_config, settings,
tenants_config) and the checks across sections in config_checks. ServeConfig, the sections and
check_tensor_parallel are importable from here too.
"""

from __future__ import annotations

from dataclasses import MISSING, fields, replace
from pathlib import Path
from typing import Any

import yaml

from coordinator.config.adaptive_config import PlannerConfig, SLOConfig
from coordinator.config.admission_config import AdmissionConfig
from coordinator.config.config_checks import check_adaptive, check_kv_cache_dtype, check_scaling, check_tensor_parallel
from coordinator.config.config_tree import ServeConfig
from coordinator.config.faults_config import MAX_SLOW_STEP_S, MAX_STALL_S, FaultsConfig
from coordinator.config.pool_config import PoolConfig
from coordinator.config.recovery_config import MAX_SPARES, RecoveryConfig
from coordinator.config.scaling_config import MAX_POOL_WORKERS, ScalingConfig
from coordinator.config.settings import ServerSettings
from coordinator.config.straggler_config import StragglerConfig
from coordinator.config.tenants_config import parse_tenants
from coordinator.config.transfer_config import NET_DEVICES, TransferConfig
from engine.config_error import ConfigError

__all__ = ["MAX_POOL_WORKERS", "MAX_SLOW_STEP_S", "MAX_SPARES", "MAX_STALL_S", "NET_DEVICES", "AdmissionConfig",
           "FaultsConfig", "PoolConfig", "RecoveryConfig", "ServeConfig", "TransferConfig", "check_tensor_parallel",
           "load_serve_config", "set_dotted"]


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
    check_scaling(config, raw, path)
    check_adaptive(config, raw, path)
    check_kv_cache_dtype(config, path)
    return config


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
