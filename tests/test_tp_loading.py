"""Tensor-parallel start-up without processes: each rank's checkpoint slices (only those bytes are read), the
layout of heads and vocabulary, the dummy load format, and a bad tensor_parallel_size."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.engine_config import EngineConfig
from engine.model.decoder import CausalLM
from engine.model.model_config import ModelConfig
from engine.model.parallel import TPGroup
from engine.model.tp_layout import TPLayout
from engine.model.weights import checkpoint_files, load_weights
from tests.test_weights import saved_tensors


def rank_model(folder: Path, rank: int, size: int) -> tuple[CausalLM, int]:
    """Rank `rank`'s shard of the checkpoint, loaded from its slices -> (model, bytes read)."""
    mc = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = CausalLM(mc, 64, TPGroup(rank, size, pg=None))  # no collective runs here
    model = model.to_empty(device="cpu")
    stats = load_weights(model, folder, TPLayout(mc, rank, size).slices())
    return model, stats.bytes


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_rank_reads_only_its_slices(checkpoints, arch, sharded):
    folder = checkpoints.get(arch, sharded=sharded)
    assert len(checkpoint_files(folder)) > 1 if sharded else len(checkpoint_files(folder)) == 1
    full = saved_tensors(folder)
    total = sum(t.numel() * t.element_size() for t in full.values())
    mc = ModelConfig.from_folder(folder)
    read = []
    for rank in range(2):
        model, nbytes = rank_model(folder, rank, 2)
        slices = TPLayout(mc, rank, 2).slices()
        state = model.state_dict()
        expected_bytes = 0
        for name, tensor in full.items():
            cut = slices.get(name)
            want = tensor if cut is None else tensor.narrow(cut[0], cut[1], cut[2] - cut[1])
            expected_bytes += want.numel() * want.element_size()
            assert torch.equal(state[name].narrow(0, 0, want.shape[0]), want), name
        assert nbytes == expected_bytes  # what the loader materialised: this rank's slices and the replicated norms
        read.append(nbytes)
    assert max(read) < 0.6 * total  # no rank materialises the whole model


def test_layout_replicates_kv_heads_when_fewer_than_ranks(checkpoints):
    mc = ModelConfig.from_folder(checkpoints.get("LlamaForCausalLM"))  # 4 heads, 2 KV heads
    assert [TPLayout(mc, r, 2).kv_head_range.as_tuple() for r in range(2)] == [(0, 1), (1, 2)]
    assert [TPLayout(mc, r, 4).kv_head_range.as_tuple() for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert TPLayout(mc, 3, 4).heads == 1 and TPLayout(mc, 3, 4).kv_heads == 1


def test_bad_tensor_parallel_size_names_the_field(checkpoints):
    folder = checkpoints.get("LlamaForCausalLM")  # 4 heads
    with pytest.raises(ValueError, match=r"EngineConfig\.tensor_parallel_size 3 must divide the model's 4 "
                                         r"attention heads"):
        LLM(str(folder), tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"EngineConfig\.tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"EngineConfig\.device_ids"):
        EngineConfig(tensor_parallel_size=2, device_ids=(0, 1))  # a CPU device
    with pytest.raises(ValueError, match=r"EngineConfig\.load_format"):
        EngineConfig(load_format="npz")


def test_dummy_load_format_needs_no_weights(tmp_path, checkpoints):
    src = checkpoints.get("LlamaForCausalLM")
    for f in src.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, tmp_path / f.name)
    with pytest.raises(ValueError, match="no model.safetensors"):
        LLM(str(tmp_path))
    llm = LLM(str(tmp_path), load_format="dummy")
    w = llm.engine.model.model.layers[0].self_attn.qkv_proj.weight  # q, k and v fused after loading
    assert 0 < w.abs().max().item() <= 1e-3 and w.std().item() > 1e-4
    assert torch.equal(llm.engine.model.model.norm.weight, torch.ones_like(llm.engine.model.model.norm.weight))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
