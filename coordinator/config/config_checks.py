"""The checks load_serve_config (coordinator.config.serve_config) runs on a built ServeConfig, across its sections:
what one section's dataclass cannot see alone (both pools' KV cache dtype, mode adaptive's and scaling pools' need
of `slo`, sections that apply to one mode only) and, before any worker starts, whether each pool's
tensor_parallel_size can split the model on disk. Each raises a ConfigError naming the file and the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.config_error import ConfigError

if TYPE_CHECKING:
    from coordinator.config.config_tree import ServeConfig


def check_kv_cache_dtype(config: ServeConfig, path: Path) -> None:
    """KV blocks move between the pools byte for byte: both pools must store the same KV cache dtype."""
    prefill, decode = config.kv_cache_dtype_of(config.prefill), config.kv_cache_dtype_of(config.decode)
    if config.mode != "collocated" and _fp8(prefill) != _fp8(decode):
        raise ConfigError(f"{path}: prefill.kv_cache_dtype {prefill!r} and decode.kv_cache_dtype {decode!r} disagree: "
                          "the KV cache moves between the pools as it is stored, so both must hold the same dtype "
                          "(set kv_cache_dtype once at the top level)")


def _fp8(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype != "auto"  # "fp8" and "fp8_e4m3" name the same cache


def check_adaptive(config: ServeConfig, raw: dict, path: Path) -> None:
    """`slo` and `planner` belong to mode adaptive, which needs `slo` (`slo` also serves pools that scale:
    check_scaling); its workers can each take the other's role."""
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


def check_scaling(config: ServeConfig, raw: dict, path: Path) -> None:
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
