"""The request fields that bend sampling and the output text beyond OpenAI's basics, and their checks.

Owns: vLLM's extensions `repetition_penalty`, `min_tokens`, `bad_words`, `include_stop_str_in_output` and
`skip_special_tokens` (declared in the SamplingFields mixin), and `processing_kwargs()`, which turns them and
OpenAI's `presence_penalty`, `frequency_penalty` and `logit_bias` into SamplingParams keywords: logit_bias keys
are token ids as strings, checked against the vocabulary (at most 300 entries, finite biases in [-100, 100]); bad
words are tokenized as vLLM does (each word as written, and with a leading space when that gives a different first
token and as many tokens), so the engine bans token sequences. Every bad value is a 400 naming its field; ranges
that SamplingParams checks itself (penalties, min_tokens) are reported by engine_inputs.sampling_params.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field

from coordinator.errors import invalid_request
from engine.core.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGIT_BIAS
from engine.text.tokenizer import Tokenizer


class SamplingFields(BaseModel):
    """vLLM's sampling and output-text extensions, on both endpoints."""

    repetition_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0, le=2**31 - 1)
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS // 2)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


def processing_kwargs(req: Any, tokenizer: Tokenizer | None, vocab_size: int | None) -> dict[str, Any]:
    """SamplingParams keywords for the penalties, logit_bias, min_tokens and bad words of a parsed request."""
    kwargs: dict[str, Any] = {"min_tokens": req.min_tokens}
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
    if req.logit_bias:
        kwargs["logit_bias"] = logit_bias(req.logit_bias, vocab_size)
    if req.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words need the tokenizer")
        kwargs["bad_words_token_ids"] = bad_words_token_ids(req.bad_words, tokenizer, vocab_size)
    return kwargs


def logit_bias(raw: dict[str, Any], vocab_size: int | None) -> dict[int, float]:
    """OpenAI's {"token id": bias} -> {id: bias}; a 400 naming logit_bias for any bad entry."""
    if len(raw) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(raw)}")
    out: dict[int, float] = {}
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit()):
            raise _bad("logit_bias", f"keys must be token ids (decimal strings), got {key[:40]!r}")
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise _bad("logit_bias", f"token id {token} is outside the vocabulary [0, {vocab_size})")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise _bad("logit_bias", f"the bias of token {token} must be a finite number, got {value!r}")
        if not -100 <= value <= 100:
            raise _bad("logit_bias", f"the bias of token {token} must be in [-100, 100], got {value}")
        out[token] = float(value)
    return out


def bad_words_token_ids(words: list[str], tokenizer: Tokenizer, vocab_size: int | None) -> list[list[int]]:
    """Each word's token ids, as vLLM tokenizes bad words: as written (its leading spaces stripped), and with one
    leading space when that starts with another token and has as many tokens (a word inside the text)."""
    out: list[list[int]] = []
    for i, word in enumerate(words):
        if not word.strip():
            raise _bad(f"bad_words[{i}]", "must hold a non-space character")
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else []):
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise _bad(f"bad_words[{i}]", f"is {len(ids)} tokens long; at most {MAX_BAD_WORD_TOKENS}")
            if vocab_size is not None and max(ids) >= vocab_size:
                raise _bad(f"bad_words[{i}]", f"encodes to token ids outside the vocabulary [0, {vocab_size})")
            out.append(ids)
    return out


def _bad(param: str, why: str) -> Exception:
    return invalid_request(f"{param}: {why}", param)
