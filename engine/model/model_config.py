"""The model's architecture description, parsed once from a Hugging Face checkpoint folder.

Owns: reading `config.json` (and the eos/bos ids of `generation_config.json`) into a frozen `ModelConfig`,
validating that the engine supports what it describes, and the `fingerprint` two engines compare before they
exchange KV blocks. It reads both the transformers 4.x keys (`rope_scaling`, `rope_theta`, `torch_dtype`) and the
5.x keys (`rope_parameters`, `dtype`). Every error names the file and the key at fault.
Torch-free on purpose: the coordinator imports it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config_error import ConfigError
from engine.model.quant_config import Fp8Scheme, read_fp8_scheme

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

_REQUIRED = object()


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1-style rotary frequency scaling (`rope_type: llama3`), the only scaling the engine implements."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a decoder-only checkpoint; built by `from_folder`, never mutated."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    sliding_window: int | None
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    fp8: Fp8Scheme | None = None  # FP8 linear weights (engine.model.quant_config); None: all in torch_dtype

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        folder = Path(folder)
        path = folder / CONFIG_FILE
        raw = _read_json(path)
        arch = _architecture(raw, path)
        get = _Getter(raw, path)
        num_heads = get("num_attention_heads", int)
        num_kv_heads = get("num_key_value_heads", int, num_heads)
        hidden_size = get("hidden_size", int)
        head_dim = get("head_dim", int, None)
        if head_dim is None:
            if hidden_size % num_heads:
                raise ConfigError(f"{path}: hidden_size {hidden_size} is not divisible by num_attention_heads "
                                  f"{num_heads} and no head_dim is given")
            head_dim = hidden_size // num_heads
        if num_heads % num_kv_heads:
            raise ConfigError(f"{path}: num_attention_heads {num_heads} is not a multiple of "
                              f"num_key_value_heads {num_kv_heads}")
        hidden_act = get("hidden_act", str, "silu")
        if hidden_act != "silu":
            raise ConfigError(f"{path}: hidden_act {hidden_act!r} is not supported (only 'silu')")
        dtype = get("dtype", str, None) or get("torch_dtype", str, "float32")
        if dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"{path}: dtype {dtype!r} is not supported (one of {SUPPORTED_DTYPES})")
        num_layers = get("num_hidden_layers", int)
        rope_theta, rope_scaling = _rope(raw, path)
        bos, eos = _special_ids(raw, path, folder / GENERATION_CONFIG_FILE)
        fp8 = read_fp8_scheme(folder, raw)
        tied = get("tie_word_embeddings", bool, False)
        if fp8 is not None and tied and fp8.quantizes("lm_head"):
            raise ConfigError(f"{path}: the FP8 quantization config does not exclude 'lm_head', but the model ties "
                              "it to the embedding (tie_word_embeddings); add it to the ignore list")
        return cls(
            architecture=arch,
            vocab_size=get("vocab_size", int),
            hidden_size=hidden_size,
            intermediate_size=get("intermediate_size", int),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps", float, 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=get("max_position_embeddings", int),
            sliding_window=_sliding_window(raw, arch, num_layers, path),
            tie_word_embeddings=tied,
            qkv_bias=arch == "Qwen2ForCausalLM" or get("attention_bias", bool, False),
            mlp_bias=get("mlp_bias", bool, False),
            qk_norm=arch == "Qwen3ForCausalLM",
            hidden_act=hidden_act,
            torch_dtype=dtype,
            bos_token_id=bos,
            eos_token_ids=eos,
            fp8=fp8,
        )

    @property
    def fingerprint(self) -> str:
        """Short stable hash of the architecture and every weight/KV shape; equal fingerprints share KV layouts."""
        shape = [self.architecture, self.vocab_size, self.hidden_size, self.intermediate_size, self.num_layers,
                 self.num_heads, self.num_kv_heads, self.head_dim, self.tie_word_embeddings, self.qkv_bias,
                 self.mlp_bias, self.qk_norm]
        return hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:16]


class _Getter:
    """Typed access to one JSON object, with errors that name the file and key."""

    def __init__(self, raw: dict[str, Any], path: Path) -> None:
        self.raw, self.path = raw, path

    def __call__(self, key: str, kind: type, default: Any = _REQUIRED) -> Any:
        if key not in self.raw or self.raw[key] is None:
            if default is _REQUIRED:
                raise ConfigError(f"{self.path}: missing required key {key!r}")
            return default
        return _check_type(self.raw[key], kind, f"{self.path}: key {key!r}")


def _check_type(value: Any, kind: type, where: str) -> Any:
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise ConfigError(f"{where} must be {kind.__name__}, got {value!r}")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found (a Hugging Face checkpoint folder needs it)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object at top level")
    return raw


def _architecture(raw: dict[str, Any], path: Path) -> str:
    archs = raw.get("architectures")
    if not archs or not isinstance(archs, list):
        raise ConfigError(f"{path}: missing required key 'architectures'")
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ConfigError(f"{path}: key 'architectures' is {archs}; unknown architecture, "
                      f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope(raw: dict[str, Any], path: Path) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling from 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`."""
    key = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
    params = raw.get(key) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{path}: key {key!r} must be an object, got {params!r}")
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    theta = _check_type(theta, float, f"{path}: key 'rope_theta'")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ConfigError(f"{path}: key {key!r} has rope type {rope_type!r}; only 'llama3' (or none) is supported")
    get = _Getter(params, path)
    try:
        scaling = RopeScaling(
            factor=get("factor", float),
            low_freq_factor=get("low_freq_factor", float),
            high_freq_factor=get("high_freq_factor", float),
            original_max_position_embeddings=get("original_max_position_embeddings", int),
        )
    except ConfigError as e:
        raise ConfigError(f"{e} (in {key!r})") from e
    return theta, scaling


def _sliding_window(raw: dict[str, Any], arch: str, num_layers: int, path: Path) -> int | None:
    """One window for every layer, or None; mixed full/sliding layers are refused rather than run wrongly."""
    if arch == "LlamaForCausalLM":
        return None
    get = _Getter(raw, path)
    window = get("sliding_window", int, None)
    if arch == "MistralForCausalLM" or window is None:
        return window
    if not get("use_sliding_window", bool, False):
        return None
    layer_types = raw.get("layer_types")
    if not isinstance(layer_types, list):
        first_sliding = get("max_window_layers", int, 28)
        layer_types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
    sliding = {t == "sliding_attention" for t in layer_types}
    if sliding == {True, False}:
        raise ConfigError(f"{path}: keys 'use_sliding_window'/'max_window_layers'/'layer_types' mix full and "
                          "sliding-window layers; the engine supports one attention kind for all layers")
    return window if sliding == {True} else None


def _special_ids(raw: dict[str, Any], path: Path, gen_path: Path) -> tuple[int | None, tuple[int, ...]]:
    """bos id and eos ids: generation_config.json wins over config.json where it sets them."""
    sources = [(raw, path)]
    if gen_path.is_file():
        sources.insert(0, (_read_json(gen_path), gen_path))
    bos: int | None = None
    eos: tuple[int, ...] | None = None
    for src, where in sources:
        if bos is None and src.get("bos_token_id") is not None:
            bos = _check_type(src["bos_token_id"], int, f"{where}: key 'bos_token_id'")
        if eos is None and src.get("eos_token_id") is not None:
            value = src["eos_token_id"]
            ids = value if isinstance(value, list) else [value]
            eos = tuple(_check_type(i, int, f"{where}: key 'eos_token_id'") for i in ids)
    return bos, eos or ()
