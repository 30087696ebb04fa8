"""Incremental detokenization of one request's output: token ids in, text deltas out.

Owns: the per-request decode window (vLLM's prefix offset / read offset scheme). Each step decodes only the
tokens since the last emitted text plus a few tokens of context before them, so the cost per token stays
constant however long the output grows, and the context makes a word's leading space (SentencePiece
Metaspace) or a byte-level merge come out as in a full decode. Text is held back while the decoded tail ends
with U+FFFD, so a delta never ends in half a UTF-8 character; `flush` releases what is held at the end.
One instance per request, used by one thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas whose concatenation is the decoded output."""

    def __init__(self, tokenizer: _Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context  # the prompt's tail, then every output id
        self._prefix_offset = 0  # start of the context window: tokens already emitted, decoded for context only
        self._read_offset = len(context)  # everything before this has been emitted
        self._text_parts: list[str] = []
        self._num_output_ids = 0

    @property
    def text(self) -> str:
        """The output text emitted so far (the concatenation of every delta)."""
        return "".join(self._text_parts)

    @property
    def num_output_ids(self) -> int:
        return self._num_output_ids

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append the request's newly generated ids; return the text they complete (may be "")."""
        delta = []
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self._num_output_ids += 1
            prefix_text = self._decode(self._prefix_offset, self._read_offset)
            new_text = self._decode(self._prefix_offset)
            if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
                delta.append(new_text[len(prefix_text):])
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
        return self._emit("".join(delta))

    def flush(self) -> str:
        """At the end of the request: the held-back tail (an incomplete character decodes to U+FFFD)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset = len(self._ids)
        return self._emit(new_text[len(prefix_text):])

    def _emit(self, delta: str) -> str:
        if delta:
            self._text_parts.append(delta)
        return delta
