"""ModelConfig.from_folder: every supported architecture as transformers writes it, 4.x-style keys, every error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config_error import ConfigError
from engine.model.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from tests.hf_checkpoints import CheckpointCache


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> CheckpointCache:
    return CheckpointCache(tmp_path_factory)


def write_config(folder: Path, **overrides: object) -> Path:
    """A Llama-3.1-8B-shaped config.json as transformers 4.x wrote it; a None override deletes the key."""
    raw: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072, "hidden_act": "silu",
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    }
    for key, value in overrides.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_parses_transformers_checkpoint(ckpts: CheckpointCache, arch: str, tied: bool) -> None:
    cfg = ModelConfig.from_folder(ckpts.get(arch, tie_word_embeddings=tied))
    assert cfg.architecture == arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (2048, 64, 128)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2, 4, 2)
    assert cfg.head_dim == (32 if arch == "Qwen3ForCausalLM" else 16)
    assert cfg.tie_word_embeddings is tied
    assert cfg.qkv_bias is (arch == "Qwen2ForCausalLM")
    assert cfg.qk_norm is (arch == "Qwen3ForCausalLM")
    assert cfg.mlp_bias is False and cfg.hidden_act == "silu" and cfg.torch_dtype == "float32"
    assert cfg.max_position_embeddings == 512 and cfg.rms_norm_eps == 1e-5
    assert cfg.bos_token_id == 2043 and cfg.eos_token_ids == (2044, 2045)
    if arch == "LlamaForCausalLM":
        assert cfg.rope_theta == 500000.0
        assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
    else:
        assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.sliding_window == (4096 if arch == "MistralForCausalLM" else None)


def test_dtype_from_transformers(ckpts: CheckpointCache) -> None:
    assert ModelConfig.from_folder(ckpts.get("Qwen2ForCausalLM", dtype="bfloat16")).torch_dtype == "bfloat16"


def test_llama31_4x_keys(tmp_path: Path) -> None:
    cfg = ModelConfig.from_folder(write_config(tmp_path))
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert cfg.head_dim == 128 and cfg.num_kv_heads == 8 and cfg.torch_dtype == "bfloat16"
    assert cfg.eos_token_ids == (128001, 128008, 128009) and cfg.bos_token_id == 128000


def test_defaults(tmp_path: Path) -> None:
    cfg = ModelConfig.from_folder(write_config(
        tmp_path, num_key_value_heads=None, rope_scaling=None, torch_dtype=None, eos_token_id=None,
        bos_token_id=None, tie_word_embeddings=None, rope_theta=None, hidden_act=None, rms_norm_eps=None))
    assert cfg.num_kv_heads == 32 and cfg.head_dim == 128 and cfg.rope_scaling is None
    assert cfg.torch_dtype == "float32" and cfg.eos_token_ids == () and cfg.bos_token_id is None
    assert cfg.tie_word_embeddings is False and cfg.rope_theta == 10000.0 and cfg.rms_norm_eps == 1e-6


def test_generation_config_eos_wins(tmp_path: Path) -> None:
    write_config(tmp_path, eos_token_id=128001)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7, "bos_token_id": 5}))
    cfg = ModelConfig.from_folder(tmp_path)
    assert cfg.eos_token_ids == (7,) and cfg.bos_token_id == 5


def test_llama2_style_and_explicit_head_dim(tmp_path: Path) -> None:
    cfg = ModelConfig.from_folder(write_config(
        tmp_path, rope_scaling=None, rope_theta=10000.0, head_dim=96, eos_token_id=2, attention_bias=True,
        mlp_bias=True, torch_dtype="float16"))
    assert cfg.head_dim == 96 and cfg.eos_token_ids == (2,) and cfg.qkv_bias and cfg.mlp_bias
    assert cfg.torch_dtype == "float16"


def test_qwen2_sliding_window(tmp_path: Path) -> None:
    base = dict(architectures=["Qwen2ForCausalLM"], sliding_window=32768, rope_scaling=None)
    off = ModelConfig.from_folder(write_config(tmp_path / "a", **base, use_sliding_window=False))
    assert off.sliding_window is None and off.qkv_bias
    on = ModelConfig.from_folder(write_config(tmp_path / "b", **base, use_sliding_window=True, max_window_layers=0))
    assert on.sliding_window == 32768
    full = write_config(tmp_path / "c", **base, use_sliding_window=True, max_window_layers=32)
    assert ModelConfig.from_folder(full).sliding_window is None
    mixed = write_config(tmp_path / "d", **base, use_sliding_window=True, max_window_layers=28)
    with pytest.raises(ConfigError, match="max_window_layers"):
        ModelConfig.from_folder(mixed)


def test_fingerprint(tmp_path: Path) -> None:
    a = ModelConfig.from_folder(write_config(tmp_path / "a"))
    same = ModelConfig.from_folder(write_config(tmp_path / "b", eos_token_id=3, torch_dtype="float32"))
    other = ModelConfig.from_folder(write_config(tmp_path / "c", num_key_value_heads=4))
    assert a.fingerprint == same.fingerprint != other.fingerprint
    assert len(a.fingerprint) == 16


@pytest.mark.parametrize(("overrides", "match"), [
    ({"architectures": ["GPT2LMHeadModel"]}, r"config\.json.*architectures.*GPT2LMHeadModel"),
    ({"architectures": None}, r"config\.json.*'architectures'"),
    ({"hidden_size": None}, r"config\.json.*missing required key 'hidden_size'"),
    ({"vocab_size": "big"}, r"config\.json.*'vocab_size' must be int"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"config\.json.*rope_scaling.*'linear'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"config\.json.*'low_freq_factor'.*rope_scaling"),
    ({"hidden_act": "gelu"}, r"config\.json.*hidden_act 'gelu'"),
    ({"torch_dtype": "float64"}, r"config\.json.*dtype 'float64'"),
    ({"num_key_value_heads": 5}, r"config\.json.*num_key_value_heads 5"),
])
def test_errors_name_file_and_key(tmp_path: Path, overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_folder(write_config(tmp_path, **overrides))


def test_rope_parameters_5x_unsupported_type(tmp_path: Path) -> None:
    write_config(tmp_path, rope_scaling=None, rope_theta=None, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match=r"config\.json.*rope_parameters.*'yarn'"):
        ModelConfig.from_folder(tmp_path)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        ModelConfig.from_folder(tmp_path)


def test_invalid_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json.*not valid JSON"):
        ModelConfig.from_folder(tmp_path)


def test_frozen(tmp_path: Path) -> None:
    cfg = ModelConfig.from_folder(write_config(tmp_path))
    with pytest.raises(AttributeError):
        cfg.hidden_size = 1  # type: ignore[misc]
