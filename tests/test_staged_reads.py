"""Weights read straight into CUDA memory (engine.model.staged_reads): bit-exact against what transformers saved,
in place or through a converted temporary, chunked across the two pinned buffers, every shard; and a damaged file
refused by name before anything is read. The reads need a CUDA device (pinned memory): those tests skip here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config_error import ConfigError
from engine.model import staged_reads
from engine.model.staged_reads import StagedReader
from engine.model.weights import load_weights
from tests.hf_checkpoints import DTYPES, CheckpointCache
from tests.test_weights import Named, saved_tensors, shapes_of


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> CheckpointCache:
    return CheckpointCache(tmp_path_factory)


def test_a_truncated_or_foreign_file_is_refused_by_name(tmp_path: Path, ckpts: CheckpointCache) -> None:
    data = (ckpts.get("LlamaForCausalLM") / "model.safetensors").read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(ConfigError, match="cut.safetensors.*truncated"):
        StagedReader(cut, torch.device("cuda"))
    foreign = tmp_path / "foreign.safetensors"
    foreign.write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match="foreign.safetensors.*not a safetensors file"):
        StagedReader(foreign, torch.device("cuda"))


@pytest.mark.gpus(1)
@pytest.mark.parametrize(("saved", "target"), [("float32", "bfloat16"), ("bfloat16", "bfloat16"),
                                               ("float32", "float32")])
@pytest.mark.parametrize("chunk", [64 << 20, 4096])  # whole tensors per chunk; every tensor over many chunks
def test_cuda_loads_equal_what_was_saved(ckpts: CheckpointCache, saved: str, target: str, chunk: int,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staged_reads, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(staged_reads, "MIN_PART_BYTES", 1024)  # several reader threads per chunk
    folder = ckpts.get("Qwen2ForCausalLM", dtype=saved, sharded=True)
    expected = saved_tensors(folder)
    model = Named(shapes_of(folder), DTYPES[target]).cuda()
    load_weights(model, folder)
    state = model.state_dict()
    for name, tensor in expected.items():
        assert state[name].dtype == DTYPES[target] and state[name].is_cuda
        assert torch.equal(state[name].cpu(), tensor.to(DTYPES[target])), name
