"""Workloads: what each benchmark request asks for (its prompt and how many tokens it may generate).

Owns `build_requests` and `iter_requests`, which turn a `WorkloadSpec` (benchclient.workload_spec: synthetic
`fixed`, `uniform` or long-tailed `chat` lengths, a local `jsonl` / `sharegpt` file, or `multiturn` conversations,
synthetic or from a file: benchclient.conversations) into a seeded, reproducible list of `BenchRequest`s. Synthetic
text prompts are built from common English words (about one token per word for Llama-class BPE tokenizers; the
stream's usage reports the exact count), so any OpenAI-compatible server can take them; `prompt_format: ids` sends
token-id lists instead (pdserve accepts them), whose lengths are exact.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchclient.conversations import build_conversations, turn_prompt
from benchclient.workload_spec import WORDS, WorkloadSpec, draw_lengths

ID_RANGE = (100, 1000)  # token ids drawn for `ids` prompts: inside any real vocabulary, clear of special tokens
CHARS_PER_TOKEN = 4     # estimate of a file reply's token count when no max_tokens is given


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int] | list[dict]   # list[dict]: chat messages from a file
    input_len: int                          # nominal (words or ids); the server's usage has the exact count
    max_tokens: int


def build_requests(spec: WorkloadSpec, n: int) -> list[BenchRequest]:
    """The first `n` of `iter_requests(spec)`."""
    return list(itertools.islice(iter_requests(spec), n))


def iter_requests(spec: WorkloadSpec) -> Iterator[BenchRequest]:
    """An endless, seeded stream of requests (the same for the same spec); files cycle through their entries."""
    rng = random.Random(spec.seed)
    if spec.kind == "multiturn":  # each conversation's first turn (a run sends the turns: benchclient.run)
        conversations = build_conversations(spec)
        yield from itertools.cycle(BenchRequest(turn_prompt(c, [], 0, chat=True), _word_len(c.users[0]),
                                                c.max_tokens[0]) for c in conversations)
    if spec.kind in ("jsonl", "sharegpt"):
        entries = load_jsonl(spec) if spec.kind == "jsonl" else load_sharegpt(spec)
        if not entries:
            raise ValueError(f"{spec.path}: no usable entries")
        yield from itertools.cycle(entries)
    while True:
        lin, lout = draw_lengths(spec, rng)
        prompt: str | list[int]
        if spec.prompt_format == "ids":
            prompt = [rng.randrange(*ID_RANGE) for _ in range(lin)]
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(lin))
        yield BenchRequest(prompt, lin, lout)


def load_jsonl(spec: WorkloadSpec) -> list[BenchRequest]:
    """One JSON object a line: `prompt` (text) or `messages` (chat), and `max_tokens` (or `output_len`)."""
    out = []
    for lineno, line in enumerate(Path(spec.path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{spec.path}:{lineno}: not valid JSON: {e}") from None
        prompt = obj.get("prompt", obj.get("messages"))
        if not isinstance(prompt, (str, list)) or not prompt:
            raise ValueError(f"{spec.path}:{lineno}: needs a non-empty 'prompt' or 'messages'")
        max_tokens = obj.get("max_tokens", obj.get("output_len", spec.output_len))
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"{spec.path}:{lineno}: max_tokens must be a positive integer, got {max_tokens!r}")
        out.append(BenchRequest(prompt, _word_len(prompt), min(max_tokens, spec.max_output_len)))
    return out


def load_sharegpt(spec: WorkloadSpec) -> list[BenchRequest]:
    """ShareGPT JSON (a list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}):
    the first human turn is the prompt; the reply's length (characters / 4) sets max_tokens."""
    try:
        data = json.loads(Path(spec.path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{spec.path}: not valid JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"{spec.path}: a ShareGPT file is a JSON list of conversations")
    out = []
    for item in data:
        turns = item.get("conversations", []) if isinstance(item, dict) else []
        if len(turns) < 2 or not turns[0].get("value") or not turns[1].get("value"):
            continue
        prompt, reply = turns[0]["value"], turns[1]["value"]
        lin = _word_len(prompt)
        if lin > spec.max_input_len:
            continue
        out.append(BenchRequest(prompt, lin, min(max(1, len(reply) // CHARS_PER_TOKEN), spec.max_output_len)))
    return out


def _word_len(prompt: str | list) -> int:
    if isinstance(prompt, str):
        return len(prompt.split())
    return sum(len(str(m.get("content", "")).split()) for m in prompt if isinstance(m, dict))
