"""Which FP8 weight quantization a checkpoint declares, parsed from its config (torch-free: the coordinator checks it).

Owns: `Fp8Scheme` and `read_fp8_scheme(folder, raw_config)`. Two layouts are read:
- compressed-tensors (llm-compressor; vLLM's `quant_method: "compressed-tensors"`): `config.json` ->
  `quantization_config` with `config_groups` whose `weights` are 8-bit floats, strategy "tensor" or "channel"
  (tensors `<linear>.weight` float8_e4m3fn [out, in] and `<linear>.weight_scale` float32 [1] or [out, 1]), and whose
  `input_activations` are dynamic per-token (nothing stored) or static per-tensor (`<linear>.input_scale` [1]).
  `ignore` names the linears left unquantized (exact module names or `re:` regular expressions).
- ModelOpt FP8 (`hf_quant_config.json` -> `quantization.quant_algo: "FP8"`, or `config.json` ->
  `quantization_config.quant_method: "modelopt"`): per-tensor weight scales and static per-tensor input scales;
  `exclude_modules` are glob patterns.
Everything else (int4/int8, block or group scales, asymmetric, a KV-cache scheme, sparsity) is refused with a
ConfigError naming the file and the key; nothing declared is silently ignored.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config_error import ConfigError

MODELOPT_FILE = "hf_quant_config.json"
CT_FORMATS = ("float-quantized", "naive-quantized")
WEIGHT_STRATEGIES = ("tensor", "channel")


@dataclass(frozen=True)
class Fp8Scheme:
    """FP8 e4m3 linears: weight scales per tensor or per output channel; activations quantized per token at run
    time ("dynamic") or with a stored per-tensor scale ("static")."""

    method: str                 # "compressed-tensors" | "modelopt"
    weight_strategy: str        # "tensor" | "channel"
    activations: str            # "dynamic" (per token) | "static" (per tensor, `input_scale` stored)
    ignore: tuple[str, ...] = ()  # module names / patterns left in the compute dtype

    def quantizes(self, module: str) -> bool:
        """Whether the linear `module` (a Hugging Face module name, e.g. "model.layers.0.mlp.up_proj") is FP8."""
        for pattern in self.ignore:
            if self.method == "compressed-tensors":
                if pattern.startswith("re:") and re.fullmatch(pattern[3:], module):
                    return False
                if pattern == module:
                    return False
            elif fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, pattern + ".*"):
                return False
        return True


def read_fp8_scheme(folder: Path, raw: dict[str, Any]) -> Fp8Scheme | None:
    """The FP8 scheme `folder`'s checkpoint declares (`raw`: its parsed config.json), or None for plain weights."""
    config_path = folder / "config.json"
    qc = raw.get("quantization_config")
    modelopt = folder / MODELOPT_FILE
    if qc is None and modelopt.is_file():
        try:
            data = json.loads(modelopt.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{modelopt}: not valid JSON: {e}") from e
        section = data.get("quantization") if isinstance(data, dict) else None
        if not isinstance(section, dict):
            raise ConfigError(f"{modelopt}: missing the object 'quantization'")
        return _modelopt(section, f"{modelopt}: key 'quantization'")
    if qc is None:
        return None
    where = f"{config_path}: key 'quantization_config'"
    if not isinstance(qc, dict):
        raise ConfigError(f"{where} must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method == "modelopt":
        return _modelopt(qc, where)
    raise ConfigError(f"{where}: quant_method {method!r} is not supported (FP8 checkpoints in the "
                      "'compressed-tensors' or 'modelopt' layout are)")


def _compressed_tensors(qc: dict[str, Any], where: str) -> Fp8Scheme:
    fmt = qc.get("format")
    if fmt not in CT_FORMATS:
        raise ConfigError(f"{where}: format {fmt!r} is not supported (FP8 weights are stored as one of {CT_FORMATS})")
    for key in ("kv_cache_scheme", "sparsity_config"):
        if qc.get(key):
            raise ConfigError(f"{where}: {key} is set; only FP8 linear weights are read from a checkpoint "
                              "(the KV cache's dtype is an engine setting)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{where}: config_groups must be a non-empty object")
    schemes = {_ct_group(group, f"{where}: config_groups.{name}") for name, group in groups.items()}
    if len(schemes) > 1:
        raise ConfigError(f"{where}: config_groups declare different schemes {sorted(schemes)}; one FP8 scheme "
                          "for every linear is supported")
    weight_strategy, activations = schemes.pop()
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise ConfigError(f"{where}: ignore must be a list of module names, got {ignore!r}")
    return Fp8Scheme("compressed-tensors", weight_strategy, activations, tuple(ignore))


def _ct_group(group: Any, where: str) -> tuple[str, str]:
    """(weight strategy, activations) of one compressed-tensors config group, or ConfigError."""
    if not isinstance(group, dict):
        raise ConfigError(f"{where} must be an object")
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise ConfigError(f"{where}.targets is {targets!r}; only ['Linear'] (every linear, less 'ignore') is supported")
    weights = group.get("weights")
    _check_fp8_args(weights, f"{where}.weights")
    if weights.get("dynamic"):
        raise ConfigError(f"{where}.weights.dynamic is true; FP8 weights need stored scales")
    strategy = weights.get("strategy")
    if strategy not in WEIGHT_STRATEGIES:
        raise ConfigError(f"{where}.weights.strategy {strategy!r} is not supported (one of {WEIGHT_STRATEGIES}; "
                          "block and group scales are not)")
    acts = group.get("input_activations")
    if acts is None:
        raise ConfigError(f"{where}.input_activations is null (weight-only FP8); supported: dynamic per-token or "
                          "static per-tensor FP8 activations")
    _check_fp8_args(acts, f"{where}.input_activations")
    act_strategy = acts.get("strategy")
    if acts.get("dynamic") is True and act_strategy == "token":
        return strategy, "dynamic"
    if acts.get("dynamic") is False and act_strategy == "tensor":
        return strategy, "static"
    raise ConfigError(f"{where}.input_activations: strategy {act_strategy!r} with dynamic "
                      f"{acts.get('dynamic')!r} is not supported (dynamic 'token' or static 'tensor')")


def _check_fp8_args(args: Any, where: str) -> None:
    if not isinstance(args, dict):
        raise ConfigError(f"{where} must be an object")
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise ConfigError(f"{where}: num_bits {args.get('num_bits')!r} type {args.get('type')!r} is not supported "
                          "(only FP8: num_bits 8, type 'float')")
    if args.get("symmetric") is False:
        raise ConfigError(f"{where}.symmetric is false; FP8 scales are symmetric")
    for key in ("group_size", "block_structure"):
        if args.get(key) is not None:
            raise ConfigError(f"{where}.{key} is set; group and block scales are not supported")


def _modelopt(section: dict[str, Any], where: str) -> Fp8Scheme:
    algo = section.get("quant_algo")
    if algo != "FP8":
        raise ConfigError(f"{where}: quant_algo {algo!r} is not supported (only 'FP8')")
    if section.get("kv_cache_quant_algo"):
        raise ConfigError(f"{where}: kv_cache_quant_algo is set; only FP8 linear weights are read from a checkpoint "
                          "(the KV cache's dtype is an engine setting)")
    exclude = section.get("exclude_modules") or section.get("ignore") or []
    if not isinstance(exclude, list) or not all(isinstance(i, str) for i in exclude):
        raise ConfigError(f"{where}: exclude_modules must be a list of module patterns, got {exclude!r}")
    return Fp8Scheme("modelopt", "tensor", "static", tuple(exclude))
