"""Test helper: tiny random Hugging Face checkpoints written by `transformers` itself, for exactness tests.

Owns: `make_hf_checkpoint` (one checkpoint folder per call: config, generation config, safetensors weights,
and the embedded tiny tokenizer's files) and `CheckpointCache` (each distinct checkpoint built once per pytest
session, under the session's base temp folder). Weights are re-drawn with larger scales than transformers'
default init (std 0.02 makes every greedy continuation repeat one token), and norms/biases are randomized too,
so that a norm or bias the engine forgets to load changes the output.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from engine.tiny import BOS, EOS, EOT, ensure_tiny_model

CONFIG_CLASSES = {
    "LlamaForCausalLM": LlamaConfig,
    "MistralForCausalLM": MistralConfig,
    "Qwen2ForCausalLM": Qwen2Config,
    "Qwen3ForCausalLM": Qwen3Config,
}
ARCHITECTURES = tuple(CONFIG_CLASSES)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RESIDUAL_GAIN = 4.0
TIED_EMBED_STD = 0.02
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _tokenizer_info(tokenizer_dir: Path) -> tuple[int, int, list[int]]:
    """(vocab size, bos id, eos ids) of the tiny tokenizer."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab_size = max(len(tok["model"]["vocab"]), max(added.values()) + 1)
    return vocab_size, added[BOS], [added[EOS], added[EOT]]


def _randomize(model: torch.nn.Module, seed: int, special_ids: list[int], tied: bool) -> None:
    """Scales that make 32-token greedy continuations varied (checked by hand: 10-32 distinct tokens per run):
    embedding rows of equal norm (else the longest row wins every step), 1/sqrt(fan_in) matrices with a large
    gain on the residual writers and small tied embeddings (else a tied head repeats its input token), and a
    damped row for every special token (else a random eos cuts greedy runs short)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                value = 1.0 + 0.2 * torch.randn(p.shape, generator=gen)
            elif name.endswith(".bias"):
                value = 0.2 * torch.randn(p.shape, generator=gen)
            elif "embed_tokens" in name or name == "lm_head.weight":
                value = torch.randn(p.shape, generator=gen)
                value *= (TIED_EMBED_STD if tied else 1.0) * p.shape[1] ** 0.5 / value.norm(dim=1, keepdim=True)
                value[special_ids] *= 0.1
            else:
                gain = RESIDUAL_GAIN if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                value = gain * torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5
            p.copy_(value)


def make_hf_checkpoint(arch: str, folder: Path, *, tie_word_embeddings: bool = False, dtype: str = "float32",
                       sharded: bool = False, seed: int = 0, tokenizer_dir: Path | None = None,
                       **overrides: Any) -> Path:
    """Write a small random `arch` checkpoint with `save_pretrained` into `folder` (created) and return it.

    hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128, vocab of the tiny tokenizer, 512 positions;
    Llama gets llama3 rope scaling, Qwen3 head_dim 32 (not 64 // 4).
    `overrides` go to the transformers config class unchanged.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else ensure_tiny_model()
    vocab_size, bos, eos = _tokenizer_info(tokenizer_dir)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos, eos_token_id=eos, rms_norm_eps=1e-5,
    )
    if arch == "LlamaForCausalLM":
        kwargs["rope_parameters"] = dict(LLAMA3_ROPE)
    if arch == "Qwen3ForCausalLM":
        kwargs["head_dim"] = 32  # Qwen3 sets head_dim apart from hidden_size // num_heads (16); keep that

    kwargs.update(overrides)
    config = CONFIG_CLASSES[arch](**kwargs)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    _randomize(model, seed, [bos, *eos], tie_word_embeddings)
    model = model.to(DTYPES[dtype])
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="100KB" if sharded else "10GB")
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, folder / name)
    return folder


class CheckpointCache:
    """Builds each distinct checkpoint once per pytest session: `CheckpointCache(tmp_path_factory).get(arch, ...)`.

    State lives on disk under the session's base temp folder, so separate instances (one per test module)
    share it; a checkpoint appears by atomic rename, so readers never see a partial one.
    """

    def __init__(self, tmp_path_factory: Any) -> None:
        self.root = Path(tmp_path_factory.getbasetemp()) / "hf_checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)

    def tiny(self) -> Path:
        return ensure_tiny_model(self.root / "cache")

    def get(self, arch: str, **kwargs: Any) -> Path:
        key = "-".join([arch] + [f"{k}={kwargs[k]}" for k in sorted(kwargs)])
        target = self.root / key.replace("/", "_")
        if not target.is_dir():
            tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=self.root))
            try:
                make_hf_checkpoint(arch, tmp, tokenizer_dir=self.tiny(), **kwargs)
                os.rename(tmp, target)
            except OSError:
                if not target.is_dir():
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return target


def make_sentencepiece_style_tokenizer(folder: Path, *, tokenizer_class: str = "LlamaTokenizer") -> Path:
    """A Llama-2-shaped tokenizer.json (Metaspace-style normalizer, byte fallback, `<s> $A` post-processor,
    `add_bos_token: true`) trained on the tiny corpus, next to a tokenizer_config.json; returns `folder`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    from engine.tiny import CORPUS

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    learner.train_from_iterator(CORPUS.splitlines(), trainers.BpeTrainer(vocab_size=1200, show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1",
                                                       special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "legacy": False, "tokenizer_class": tokenizer_class,
              "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder
