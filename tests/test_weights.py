"""load_weights: bit-exact against what transformers saved, dtype conversion, tied heads, and every error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from engine.model.model_config import SUPPORTED_ARCHITECTURES
from engine.model.weights import WeightsError, checkpoint_files, load_weights
from tests.hf_checkpoints import DTYPES, CheckpointCache


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> CheckpointCache:
    return CheckpointCache(tmp_path_factory)


def saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            out |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    return out


def fresh_hf_model(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """An untrained transformers model of the checkpoint's config: weights differ from the saved ones."""
    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(12345)
    return AutoModelForCausalLM.from_config(config).to(dtype)


class Named(torch.nn.Module):
    """A bare module whose state_dict names are exactly `shapes`' keys (what the engine's model looks like)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        for name, shape in shapes.items():
            *path, leaf = name.split(".")
            module: torch.nn.Module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(torch.full(shape, float("nan"), dtype=dtype)))


def shapes_of(folder: Path) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in saved_tensors(folder).items()}


def assert_same(model: torch.nn.Module, expected: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    state = model.state_dict()
    for name, tensor in expected.items():
        assert state[name].dtype == dtype
        assert torch.equal(state[name], tensor.to(dtype)), name


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_transformers_model_bit_exact(ckpts: CheckpointCache, arch: str, tied: bool) -> None:
    folder = ckpts.get(arch, tie_word_embeddings=tied)
    model = fresh_hf_model(folder, torch.float32)
    expected = saved_tensors(folder)
    assert not torch.equal(model.state_dict()["model.embed_tokens.weight"], expected["model.embed_tokens.weight"])
    load_weights(model, folder)
    assert_same(model, expected, torch.float32)
    if tied:
        assert "lm_head.weight" not in expected
        assert torch.equal(model.lm_head.weight, expected["model.embed_tokens.weight"])


def test_sharded_checkpoint(ckpts: CheckpointCache) -> None:
    folder = ckpts.get("Qwen2ForCausalLM", sharded=True)
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(checkpoint_files(folder)) > 1
    model = fresh_hf_model(folder, torch.float32)
    load_weights(model, folder)
    assert_same(model, saved_tensors(folder), torch.float32)


@pytest.mark.parametrize(("saved", "target"), [
    ("bfloat16", "float32"), ("float16", "float32"), ("float32", "bfloat16"), ("float32", "float16"),
    ("bfloat16", "bfloat16"), ("float16", "float16"),
])
def test_dtype_conversion(ckpts: CheckpointCache, saved: str, target: str) -> None:
    folder = ckpts.get("LlamaForCausalLM", dtype=saved)
    expected = saved_tensors(folder)
    assert expected["model.norm.weight"].dtype == DTYPES[saved]
    model = Named(shapes_of(folder), DTYPES[target])
    load_weights(model, folder)
    assert_same(model, expected, DTYPES[target])


def test_engine_style_tied_model_ignores_stored_head(tmp_path: Path, ckpts: CheckpointCache) -> None:
    """A tied model has no lm_head.weight; a tied checkpoint that stores one anyway still loads."""
    tensors = saved_tensors(ckpts.get("LlamaForCausalLM"))
    save_file(tensors, str(tmp_path / "untied.safetensors"))
    shapes = {n: tuple(t.shape) for n, t in tensors.items() if n != "lm_head.weight"}
    with pytest.raises(WeightsError, match=r"untied\.safetensors: tensor 'lm_head\.weight' differs"):
        load_weights(Named(shapes), tmp_path)  # untied weights into a tied model: refuse, never drop the head
    (tmp_path / "untied.safetensors").unlink()
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shapes = {n: tuple(t.shape) for n, t in tensors.items() if n != "lm_head.weight"}
    model = Named(shapes)
    load_weights(model, tmp_path)
    assert "lm_head.weight" not in model.state_dict()
    assert_same(model, {n: t for n, t in tensors.items() if n in shapes}, torch.float32)


def test_rotary_inv_freq_ignored_and_any_safetensors_name(tmp_path: Path) -> None:
    tensors = {"model.norm.weight": torch.arange(4.0), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2)}
    save_file(tensors, str(tmp_path / "pytorch_model-00001.safetensors"))
    model = Named({"model.norm.weight": (4,)})
    load_weights(model, tmp_path)
    assert torch.equal(model.state_dict()["model.norm.weight"], torch.arange(4.0))


def test_no_safetensors(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(WeightsError, match=rf"{tmp_path}.*no model\.safetensors"):
        load_weights(Named({"w": (1,)}), tmp_path)


def test_index_names_missing_shard(tmp_path: Path, ckpts: CheckpointCache) -> None:
    folder = shutil.copytree(ckpts.get("Qwen2ForCausalLM", sharded=True), tmp_path / "ck")
    shards = sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))
    (folder / shards[-1]).unlink()
    with pytest.raises(WeightsError, match=rf"shard '{shards[-1]}'"):
        load_weights(Named(shapes_of(ckpts.get("Qwen2ForCausalLM", sharded=True))), folder)


def test_unexpected_tensor(ckpts: CheckpointCache) -> None:
    folder = ckpts.get("Qwen3ForCausalLM")
    shapes = shapes_of(folder)
    del shapes["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(WeightsError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.1\.self_attn\.k_n"):
        load_weights(Named(shapes), folder)


def test_missing_tensors(ckpts: CheckpointCache) -> None:
    folder = ckpts.get("MistralForCausalLM")
    shapes = shapes_of(folder) | {"model.layers.0.self_attn.q_proj.bias": (64,), "model.extra.weight": (3,)}
    with pytest.raises(WeightsError, match=r"lacks 2 tensor.*q_proj\.bias.*model\.extra\.weight"):
        load_weights(Named(shapes), folder)


def test_shape_mismatch(ckpts: CheckpointCache) -> None:
    folder = ckpts.get("LlamaForCausalLM")
    shapes = shapes_of(folder) | {"model.layers.0.mlp.up_proj.weight": (64, 128)}
    with pytest.raises(WeightsError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.up_proj\.weight' "
                                           r"has shape \(128, 64\) in the checkpoint but \(64, 128\) in the model"):
        load_weights(Named(shapes), folder)


def test_corrupt_index(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(WeightsError, match=r"index\.json.*weight_map"):
        load_weights(Named({"w": (1,)}), tmp_path)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_helper_checkpoints_give_varied_greedy_output(ckpts: CheckpointCache, arch: str, tied: bool) -> None:
    """The exactness tests compare greedy runs; a checkpoint that repeats one token would prove little."""
    model = AutoModelForCausalLM.from_pretrained(ckpts.get(arch, tie_word_embeddings=tied)).eval()
    prompt = torch.tensor([[2043, 435, 497, 600, 1148, 446]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, prompt.shape[1]:]
    assert len(out) == 32 and len(set(out.tolist())) >= 8
