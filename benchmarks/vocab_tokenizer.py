"""A Llama-3-shaped byte-level BPE tokenizer of exactly a given vocabulary size, synthesized in seconds: a helper of
the benchmarks, not a benchmark (every random checkpoint of make_random_checkpoint.py carries one, so the figures of
docs/benchmarks.md on big shapes stream, detokenize and mask over it; tests/test_vocab_tokenizer.py tests it).

Owns: `build_tokenizer` (a `tokenizers.Tokenizer`) and `write_tokenizer` (tokenizer.json + tokenizer_config.json into
a checkpoint folder), for the random-weight benchmark checkpoints (make_random_checkpoint.py) and the grammar
benchmarks; and `synthesize_merges(count)`, the made-up merge list they are built from. A model of vocabulary V
samples any id below V; this tokenizer gives each of them text, so streamed output, detokenization and grammar masks
cost what they cost with a real tokenizer of that size. It lives in benchmarks/ because only benchmarks and their
tests build tokenizers; the engine only reads them.

Layout, Llama 3's: ids 0-255 are the bytes, then merged tokens, then `num_special` special tokens at the top:
<|begin_of_text|>, <|end_of_text|>, <|reserved_special_token_0..3|>, <|start_header_id|>, <|end_header_id|>,
<|reserved_special_token_4|>, <|eot_id|>, then reserved tokens 5, 6, ... to the end. The pre-tokenizer split, the
decoder and the chat template are the tiny model's (Llama 3's).

The merges are made up, not trained: every token is what the merges make of its own bytes, as in a trained BPE, and
every merged token is whole UTF-8 text, so only the bytes 0x80-0xFF decode alone to U+FFFD (they are parts of
characters). The same arguments give the same bytes. `synthesize_merges(count)` gives the merge list in rank order,
as pairs of byte strings. Training 128k merges on a corpus takes minutes; these take seconds. Words are proposed in
this order: letter pairs, numbers up to three digits, whitespace and punctuation runs, two-byte UTF-8 letters
(Latin, Greek, Cyrillic), English words (the benchmark client's prompt words and the tiny corpus's, bare, after a
space and capitalized, so a text prompt costs about a token a word), then seeded random words of 3 to 12 letters
(bare, after a space, capitalized, or after one of `_.(/-@$#`). Consistency, as in a trained BPE: each proposed word
is made a token by merging, one new merge at a time, two adjacent pieces of what the merges so far make of it, until
it is one piece. So every token is what the merges make of its own bytes. That matters beyond looks: llguidance
tokenizes the text a grammar forces with the merges and allows only that tokenization, so a token that the merges
cannot reach would be masked where it is valid. Every merged token is whole UTF-8 text (a letter's two bytes are
merged before anything joins them). (Until f1a5769 the merges were benchmarks/bpe_merges.py.)
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from benchclient.workload import WORDS
from engine.tiny import BOS, CHAT_TEMPLATE, CORPUS, EOS, EOT, SPLIT_PATTERN

# (characters, weight) of the random words, most of them 4-8 long as in real vocabularies.
_WORD_LENGTHS = ((3, 6), (4, 12), (5, 14), (6, 14), (7, 13), (8, 11), (9, 8), (10, 6), (11, 4), (12, 2))
# (kind, weight) of the random words: after a space is the commonest in real vocabularies.
_WORD_KINDS = (("lower", 30), ("space", 40), ("cap", 8), ("space_cap", 12), ("lead", 10))
_LEAD_CHARS = b"_.(/-@$#"
SEED = 0
_BYTES = [bytes([b]) for b in range(256)]


class _Merges:
    """The merge list being built, with the BPE that applies it (lowest rank first, leftmost on ties)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pairs: list[tuple[bytes, bytes]] = []
        self.ranks: dict[tuple[bytes, bytes], int] = {}
        self.tokens = {bytes([b]) for b in range(256)}

    @property
    def full(self) -> bool:
        return len(self.pairs) == self.capacity

    def segment(self, word: bytes) -> list[bytes]:
        parts = [_BYTES[b] for b in word]
        ranks = self.ranks
        while len(parts) > 1:
            best, at, left = None, 0, parts[0]
            for i in range(1, len(parts)):
                rank = ranks.get((left, parts[i]))
                if rank is not None and (best is None or rank < best):
                    best, at = rank, i
                left = parts[i]
            if best is None:
                break
            parts[at - 1:at + 1] = [parts[at - 1] + parts[at]]
        return parts

    def make(self, word: bytes) -> bool:
        """Merge pieces of `word` until it is one token (shortest adjacent pair first, as frequent pairs are merged
        first in training); False if the list fills first or no new pair is left."""
        parts = self.segment(word)
        while len(parts) > 1:
            if self.full:
                return False
            order = sorted(range(len(parts) - 1), key=lambda i: (len(parts[i]) + len(parts[i + 1]), i))
            new = [i for i in order if parts[i] + parts[i + 1] not in self.tokens]
            if not new:  # every pair here forms a token the merges reach another way
                return False
            pair = parts[new[0]], parts[new[0] + 1]
            self.ranks[pair] = len(self.pairs)
            self.pairs.append(pair)
            self.tokens.add(pair[0] + pair[1])
            parts = _merge_all(parts, pair)
        return True


def _merge_all(parts: list[bytes], pair: tuple[bytes, bytes]) -> list[bytes]:
    """What BPE does next with the newest merge: no older merge applies to `parts` (it is a finished segmentation)
    and none involves the new token, so it only joins each occurrence of `pair`, left to right."""
    out: list[bytes] = []
    i = 0
    while i < len(parts):
        if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
            out.append(parts[i] + parts[i + 1])
            i += 2
        else:
            out.append(parts[i])
            i += 1
    return out


def _fixed_words() -> Iterator[bytes]:
    """The short tokens every byte-level vocabulary has, commonest kinds first."""
    lower, upper, digits, punct = (s.encode() for s in (string.ascii_lowercase, string.ascii_uppercase,
                                                        string.digits, string.punctuation))
    yield from (bytes([32, c]) for c in lower + upper)
    yield from (bytes([a, b]) for a in lower for b in lower)
    yield from (bytes([a, b]) for a in upper for b in lower)
    yield from (bytes([a, b]) for a in digits for b in digits)
    yield from (bytes([a, b, c]) for a in digits for b in digits for c in digits)
    for run, longest in ((b" ", 16), (b"\n", 4), (b"\t", 4)):
        yield from (run * n for n in range(2, longest + 1))
    yield from (bytes([p, 10]) for p in b" .,:;{}")
    yield from (bytes([32, p]) for p in punct)
    yield from (bytes([a, b]) for a in punct for b in punct)
    for cp in [*range(0xC0, 0x250), *range(0x391, 0x3CA), *range(0x410, 0x450)]:
        if chr(cp).isalpha():
            yield chr(cp).encode()


def english_words() -> list[str]:
    """The benchmark client's prompt words and the tiny model's corpus words, lowercase, sorted."""
    words = {w.lower() for w in WORDS} | {w.lower() for w in re.findall(r"[A-Za-z]+", CORPUS)}
    return sorted(w for w in words if len(w) > 1)


def _kind(word: bytes) -> str | None:
    """The random-word kind an ASCII-letter token continues (None for other tokens)."""
    spaced = word.startswith(b" ")
    bare = word[1:] if spaced else word
    if not bare.isalpha():  # ASCII letters only
        return None
    if bare.islower():
        return "space" if spaced else "lower"
    if bare[:1].isupper() and (len(bare) == 1 or bare[1:].islower()):
        return "space_cap" if spaced else "cap"
    return None


def _random_words(merges: _Merges, rng: random.Random) -> None:
    """Seeded random words until the list is full: an earlier token of the word's kind and a short lowercase piece,
    word lengths drawn from `_WORD_LENGTHS` (so they do not pile up at the longest)."""
    by_len: dict[tuple[str, int], list[bytes]] = {}
    for token in sorted(merges.tokens):
        kind = _kind(token)
        if kind is not None:
            by_len.setdefault((kind, len(token)), []).append(token)
    short = [t for n in (1, 2, 3) for t in by_len.get(("lower", n), [])]
    kinds, kind_weights = zip(*_WORD_KINDS, strict=True)
    lengths, length_weights = zip(*_WORD_LENGTHS, strict=True)
    while not merges.full:
        kind, length = rng.choices(kinds, kind_weights)[0], rng.choices(lengths, length_weights)[0]
        right = rng.choice(short)
        if kind == "lead":
            left = bytes([rng.choice(_LEAD_CHARS)])
        else:
            lefts = by_len.get((kind, length - len(right)))
            if not lefts:
                continue
            left = rng.choice(lefts)
        word = left + right
        if word in merges.tokens or not merges.make(word) or kind == "lead":
            continue
        by_len.setdefault((kind, length), []).append(word)
        if kind == "lower" and length <= 3:
            short.append(word)


def synthesize_merges(count: int) -> list[tuple[bytes, bytes]]:
    """`count` merges in rank order; the same count gives the same list."""
    merges = _Merges(count)
    for word in _fixed_words():
        merges.make(word)
    for word in english_words():
        for variant in (word, " " + word, word.capitalize(), " " + word.capitalize()):
            merges.make(variant.encode())
    _random_words(merges, random.Random(SEED))
    return merges.pairs


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
