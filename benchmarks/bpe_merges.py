"""Made-up byte-level BPE merges, any number of them, that behave like trained ones (for vocab_tokenizer.py).

Owns: `synthesize_merges(count)`, the merge list in rank order, as pairs of byte strings. Training 128k merges on a
corpus takes minutes; these take seconds. Words are proposed in this order: letter pairs, numbers up to three digits,
whitespace and punctuation runs, two-byte UTF-8 letters (Latin, Greek, Cyrillic), English words (the benchmark
client's prompt words and the tiny corpus's, bare, after a space and capitalized, so a text prompt costs about a token
a word), then seeded random words of 3 to 12 letters (bare, after a space, capitalized, or after one of `_.(/-@$#`).

Consistency, as in a trained BPE: each proposed word is made a token by merging, one new merge at a time, two
adjacent pieces of what the merges so far make of it, until it is one piece. So every token is what the merges make
of its own bytes. That matters beyond looks: llguidance tokenizes the text a grammar forces with the merges and
allows only that tokenization, so a token that the merges cannot reach would be masked where it is valid.
Every merged token is whole UTF-8 text (a letter's two bytes are merged before anything joins them).
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Iterator

from benchclient.workload import WORDS
from engine.tiny import CORPUS

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
