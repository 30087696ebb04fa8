"""A Llama-3-shaped byte-level BPE tokenizer of exactly a given vocabulary size, synthesized in seconds.

Owns: `build_tokenizer` (a `tokenizers.Tokenizer`) and `write_tokenizer` (tokenizer.json + tokenizer_config.json into
a checkpoint folder), for the random-weight benchmark checkpoints (make_random_checkpoint.py) and the grammar
benchmarks. A model of vocabulary V samples any id below V; this tokenizer gives each of them text, so streamed
output, detokenization and grammar masks cost what they cost with a real tokenizer of that size. It lives in
benchmarks/ because only benchmarks and their tests build tokenizers; the engine only reads them.

Layout, Llama 3's: ids 0-255 are the bytes, then merged tokens, then `num_special` special tokens at the top:
<|begin_of_text|>, <|end_of_text|>, <|reserved_special_token_0..3|>, <|start_header_id|>, <|end_header_id|>,
<|reserved_special_token_4|>, <|eot_id|>, then reserved tokens 5, 6, ... to the end. The pre-tokenizer split, the
decoder and the chat template are the tiny model's (Llama 3's).

The merges are made up, not trained (benchmarks/bpe_merges.py): every token is what the merges make of its own bytes,
as in a trained BPE, and every merged token is whole UTF-8 text, so only the bytes 0x80-0xFF decode alone to U+FFFD
(they are parts of characters). The same arguments give the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from benchmarks.bpe_merges import synthesize_merges
from engine.tiny import BOS, CHAT_TEMPLATE, EOS, EOT, SPLIT_PATTERN

NUM_SPECIAL = 256
# Llama 3's first ten special tokens; the rest are reserved ones.
_NAMED = {0: BOS, 1: EOS, 6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: EOT}


@dataclass(frozen=True)
class SpecialIds:
    """The ids a checkpoint's config.json must agree with."""

    bos: int
    eos: int
    eot: int

    @property
    def eos_ids(self) -> list[int]:
        """What generation stops at (config.json's `eos_token_id`, as Llama 3 Instruct: end of text, end of turn)."""
        return [self.eos, self.eot]


def special_tokens(count: int) -> list[str]:
    """Llama 3's special tokens, `count` of them, in id order."""
    if count <= max(_NAMED):
        raise ValueError(f"need at least {max(_NAMED) + 1} special tokens (Llama 3's named ones), got {count}")
    out, reserved = [], 0
    for i in range(count):
        if i in _NAMED:
            out.append(_NAMED[i])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return out


def byte_alphabet() -> dict[int, str]:
    """The byte-level pre-tokenizer's byte -> character map: printable Latin-1 bytes stand for themselves, the
    others (controls, space, 0x7F-0xA0, 0xAD) for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in set(printable)]
    return {**{b: chr(b) for b in printable}, **{b: chr(0x100 + n) for n, b in enumerate(others)}}


def build_tokenizer(vocab_size: int, num_special: int = NUM_SPECIAL) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids, the last `num_special` of them special tokens."""
    num_merges = vocab_size - num_special - 256
    if num_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} is below 256 byte tokens + {num_special} special tokens")
    alphabet = byte_alphabet()

    def mapped(piece: bytes) -> str:
        return "".join(alphabet[b] for b in piece)

    merges = [(mapped(a), mapped(b)) for a, b in synthesize_merges(num_merges)]
    if len(merges) != num_merges:
        raise RuntimeError(f"synthesized {len(merges)} merges, wanted {num_merges}")
    vocab = {alphabet[b]: b for b in range(256)}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens(num_special)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, tok.token_to_id(BOS))])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"built {tok.get_vocab_size(with_added_tokens=True)} ids, wanted {vocab_size}")
    return tok


def special_ids(tok: Tokenizer) -> SpecialIds:
    return SpecialIds(tok.token_to_id(BOS), tok.token_to_id(EOS), tok.token_to_id(EOT))


def write_tokenizer(folder: Path, vocab_size: int, model_max_length: int = 8192) -> SpecialIds:
    """tokenizer.json and tokenizer_config.json (chat template, bos/eos named as tiny's) into `folder`."""
    tok = build_tokenizer(vocab_size)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOT, "chat_template": CHAT_TEMPLATE,
              "clean_up_tokenization_spaces": False, "model_max_length": model_max_length,
              "tokenizer_class": "PreTrainedTokenizerFast", "model_input_names": ["input_ids", "attention_mask"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return special_ids(tok)
