"""TextOutput: one request's output text as the client sees it, built token by token.

Owns: incremental detokenization (engine.detokenizer.IncrementalDetokenizer, which never emits half a UTF-8
character; special tokens' text skipped unless `skip_special_tokens` is false) and stop strings. The output ends
right before the earliest stop string (or right after it, with `include_stop_str_in_output`), which may span
several tokens or deltas; as vLLM, stop strings are only looked for once more than `min_tokens` tokens came. While
streaming, text that could be the beginning of a stop string is held back until it is known not to be one;
`finish()` releases it when the backend ends the request. Also the per-token text that logprobs report.
One instance per request, used by one task.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.request import TokenLogprob
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0  # OpenAI's lowest logprob; vLLM clamps to it too


def floored(logprob: float) -> float:
    """`logprob`, or LOGPROB_FLOOR for anything below it, -inf and NaN included."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR

@dataclass(frozen=True)
class TokenInfo:
    """One generated token for logprobs: its text, where it starts in the output text, and its alternatives."""

    token_id: int
    text: str  # as logprobs name it (TextOutput.token_name)
    bytes: list[int]  # the token's own bytes (UTF-8 of its text, or the raw bytes of a partial character)
    offset: int
    logprob: float
    top: list[tuple[str, list[int], float]]


class TextOutput:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 min_tokens: int = 0, tokens_as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids: logprobs say `token_id:<id>`
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stops = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._held = ""          # decoded but not emitted: may be the start of a stop string
        self._emitted: list[str] = []
        self._emitted_len = 0
        self.num_tokens = 0      # tokens consumed (up to and including the one that completed a stop string)
        self.stopped = False     # a stop string matched: the request must end with "stop"
        self._last_offset = 0    # where the last consumed token's text starts in the output

    @property
    def text(self) -> str:
        """Everything emitted so far (the concatenation of the returned deltas)."""
        return "".join(self._emitted)

    def add_token(self, token_id: int) -> str:
        """Consume one generated token; return the text that is now safe to send (may be "")."""
        if self.stopped:
            raise RuntimeError("TextOutput: token after a stop string matched")
        self.num_tokens += 1
        self._last_offset = self._emitted_len + len(self._held)
        return self._push(self._detok.step([token_id]), final=False)

    def finish(self) -> str:
        """The request ended: release the held-back text (a dangling partial character decodes to U+FFFD)."""
        if self.stopped:
            return ""
        return self._push(self._detok.flush(), final=True)

    def token_info(self, lp: TokenLogprob) -> TokenInfo:
        """Logprobs entry for a token just consumed; offset = where the token's text starts in the output. Values
        below LOGPROB_FLOOR (a token a grammar masked out has -inf) are given as the floor, as OpenAI and vLLM do:
        JSON has no infinity."""
        top = sorted(lp.top_logprobs.items(), key=lambda kv: -kv[1])
        return TokenInfo(lp.token_id, self.token_name(lp.token_id), self.token_text(lp.token_id)[1],
                         self._last_offset, floored(lp.logprob),
                         [(self.token_name(t), self.token_text(t)[1], floored(v)) for t, v in top])

    def token_name(self, token_id: int) -> str:
        """How logprobs name a token: its text, or `token_id:<id>` with tokens_as_ids."""
        return f"token_id:{token_id}" if self.tokens_as_ids else self.token_text(token_id)[0]

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """A single token's text and bytes; a token holding part of a UTF-8 character reads `bytes:\\xNN` (vLLM)."""
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            piece = self._tokenizer.id_to_token(token_id) or ""
            if piece:
                raw = _byte_level_bytes(piece)
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)
        return text, list(text.encode())

    def _push(self, new_text: str, final: bool) -> str:
        buf = self._held + new_text
        if not self._stops or self.num_tokens <= self._min_tokens:
            self._held = ""
            return self._emit(buf)  # no stop string can end the output yet: nothing to hold back
        hits = [(i, -len(s)) for i, s in ((buf.find(s), s) for s in self._stops) if i >= 0]
        if hits:
            at, minus_len = min(hits)  # the earliest; the longest of those starting there
            self.stopped = True
            self._held = ""
            return self._emit(buf[:at - minus_len if self._include_stop else at])
        keep = 0 if final else self._partial_stop_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return self._emit(buf[:len(buf) - keep])

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        longest = 0
        for s in self._stops:
            i = buf.find(s[0], max(0, len(buf) - len(s) + 1))
            while i >= 0 and len(buf) - i > longest:
                if s.startswith(buf[i:]):
                    longest = len(buf) - i
                    break
                i = buf.find(s[0], i + 1)
        return longest

    def _emit(self, text: str) -> str:
        if text:
            self._emitted.append(text)
            self._emitted_len += len(text)
        return text


def _byte_level_bytes(piece: str) -> bytes:
    """The bytes a GPT-2 byte-level token string stands for (its printable-character alphabet reversed)."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
        return bytes([int(piece[3:5], 16)])
    table = _byte_decoder()
    if all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return piece.encode("utf-8", errors="replace")


def _byte_decoder() -> dict[str, int]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}
