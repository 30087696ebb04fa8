"""The embedded tiny checkpoint: byte-identical builds, atomic concurrent builds, loadable by transformers."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.model.model_config import ModelConfig, RopeScaling
from engine.model.weights import load_weights
from engine.text.tokenizer import Tokenizer
from engine.tiny import CACHE_ENV, TINY_MODEL_NAME, TINY_VERSION, ensure_tiny_model, resolve_model_path

REPO = Path(__file__).resolve().parents[1]
FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def build_in_subprocess(cache: Path, hash_seed: str) -> subprocess.Popen:
    code = f"from engine.tiny import ensure_tiny_model; ensure_tiny_model({str(cache)!r})"
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny-cache"))


def test_layout(tiny: Path) -> None:
    assert tiny.name == TINY_VERSION
    assert sorted(p.name for p in tiny.iterdir()) == FILES
    assert [p.name for p in tiny.parent.iterdir()] == [TINY_VERSION]  # no temp folder left behind


def test_same_bytes_across_processes(tiny: Path, tmp_path: Path) -> None:
    """Different hash seeds catch any dict/set ordering leaking into the tokenizer or weights."""
    procs = [build_in_subprocess(tmp_path / str(i), seed) for i, seed in enumerate(["1", "2"])]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    reference = digests(tiny)
    for i in range(2):
        assert digests(tmp_path / str(i) / TINY_VERSION) == reference


def test_concurrent_builders_share_one_complete_folder(tiny: Path, tmp_path: Path) -> None:
    procs = [build_in_subprocess(tmp_path, str(i)) for i in range(4)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0, 0]
    assert [p.name for p in tmp_path.iterdir()] == [TINY_VERSION]
    assert digests(tmp_path / TINY_VERSION) == digests(tiny)


def test_reused_not_rebuilt(tiny: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()}
    assert ensure_tiny_model(tiny.parent) == tiny
    assert {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()} == before


def test_cache_env_and_resolve(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tiny.parent))
    assert ensure_tiny_model() == tiny
    assert resolve_model_path(TINY_MODEL_NAME) == tiny
    assert resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model_path(str(tmp_path / "no-such-model"))


def test_engine_reads_it(tiny: Path) -> None:
    cfg = ModelConfig.from_folder(tiny)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.torch_dtype == "float32"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (256, 4, 8, 4, 32)
    assert (cfg.intermediate_size, cfg.max_position_embeddings, cfg.rope_theta) == (688, 2048, 500000.0)
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 256) and not cfg.tie_word_embeddings
    tok = Tokenizer.from_folder(tiny)
    assert cfg.vocab_size == tok.vocab_size == 2048
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    ids = [tok.encode(n, add_special_tokens=False) for n in names]
    assert ids == [[i] for i in range(2043, 2048)] and tok.special_token_ids == set(range(2043, 2048))
    assert cfg.bos_token_id == tok.bos_token_id == 2043 and cfg.eos_token_ids == (2044, 2045)
    assert tok.eos_token_id == 2045 and tok.encode("hi")[0] == 2043
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert prompt == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>" \
                     "<|start_header_id|>assistant<|end_header_id|>\n\n"
    text = "The keeper climbed the winding stairs to light the lamp."
    assert len(tok.encode(text)) < len(text) // 3  # a trained BPE, not bytes


def test_weight_statistics(tiny: Path) -> None:
    from safetensors.torch import load_file

    tensors = load_file(tiny / "model.safetensors")
    assert len(tensors) == 2 + 4 * 9 + 1
    assert all(torch.equal(t, torch.ones_like(t)) for n, t in tensors.items() if n.endswith("norm.weight"))
    std = tensors["model.layers.0.mlp.gate_proj.weight"].std().item()
    assert 0.019 < std < 0.021
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


def test_transformers_loads_and_runs(tiny: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    hf_tok = AutoTokenizer.from_pretrained(tiny)
    ids = hf_tok("The old lighthouse", return_tensors="pt").input_ids
    assert ids[0].tolist() == Tokenizer.from_folder(tiny).encode("The old lighthouse")
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert logits.shape == (1, ids.shape[1], 2048) and torch.isfinite(logits).all()
    assert out.shape[1] > ids.shape[1]
    ours = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny)).eval()
    load_weights(ours, tiny)  # our loader fills a transformers model identically to from_pretrained
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, logits)
    assert json.loads((tiny / "generation_config.json").read_text())["eos_token_id"] == [2044, 2045]
