"""Multi-turn conversations for the `multiturn` workload: chats and agents resend their whole history every turn.

Owns `Conversation` (a seeded script: an optional system prompt, the user messages of its turns, each turn's output
budget and the think time before the next), `build_conversations` (synthetic, or from a `jsonl` file of real
conversations) and `turn_prompt`, which lays a turn out as the request sends it: the history (system prompt, every
earlier user message and the server's own replies to them) then the new user message, as chat messages or, for the
completions endpoint, as one text. A reply is what the server answered, so a turn's prompt starts with exactly the
tokens the previous turn's request held (its prompt and its output): what a prefix cache, and a host tier under it,
can serve. Synthetic lengths are drawn like the `chat` kind's (log-normal around input_len / output_len); think times
are exponential around `think_time_s`; a `system_prompt_len` > 0 puts one system prompt, the same for every
conversation, in front of each.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from benchclient.workload_spec import WORDS, WorkloadSpec, draw_lengths


@dataclass(frozen=True)
class Conversation:
    index: int
    system: str | None
    users: tuple[str, ...]        # each turn's new user message
    max_tokens: tuple[int, ...]   # each turn's output budget
    think_s: tuple[float, ...]    # the pause after each turn's reply, before the next turn is sent

    @property
    def turns(self) -> int:
        return len(self.users)


def build_conversations(spec: WorkloadSpec) -> list[Conversation]:
    """`spec.conversations` conversations (seeded): synthetic, or the file's (its first `conversations`, cycled
    when it holds fewer)."""
    rng = random.Random(spec.seed)
    if spec.path:
        scripts = load_conversations(spec)
        return [_numbered(scripts[i % len(scripts)], i, spec, rng) for i in range(spec.conversations)]
    system = " ".join(rng.choice(WORDS) for _ in range(spec.system_prompt_len)) if spec.system_prompt_len else None
    out = []
    for i in range(spec.conversations):
        users, budgets = [], []
        for _ in range(spec.turns):
            lin, lout = draw_lengths(spec, rng)
            users.append(" ".join(rng.choice(WORDS) for _ in range(lin)))
            budgets.append(lout)
        out.append(Conversation(i, system, tuple(users), tuple(budgets), _thinks(spec, rng, spec.turns)))
    return out


def turn_prompt(conv: Conversation, replies: list[str], turn: int, chat: bool) -> str | list[dict]:
    """Turn `turn`'s prompt: the history (with the server's `replies` to the turns before) and its user message."""
    if not chat:  # each turn's text is the previous turn's prompt, its reply as sent, then the new message
        parts = [f"System: {conv.system}\n\n"] if conv.system else []
        parts += [f"User: {conv.users[k]}\n\nAssistant:{replies[k]}\n\n" for k in range(turn)]
        return "".join(parts) + f"User: {conv.users[turn]}\n\nAssistant:"
    messages = [{"role": "system", "content": conv.system}] if conv.system else []
    for k in range(turn):
        messages += [{"role": "user", "content": conv.users[k]}, {"role": "assistant", "content": replies[k]}]
    return messages + [{"role": "user", "content": conv.users[turn]}]


def load_conversations(spec: WorkloadSpec) -> list[Conversation]:
    """A `jsonl` file of conversations: one JSON object a line with `messages` (OpenAI chat messages: an optional
    leading system message, then user messages, each optionally followed by the assistant's reply in the original
    conversation, whose length in words, or `max_tokens` on the user message, sets that turn's output budget;
    otherwise output_len). Only the user messages are sent: the replies are the server's. At most `turns` turns."""
    out = []
    for lineno, line in enumerate(Path(spec.path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{spec.path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON: {e}") from None
        messages = obj.get("messages") if isinstance(obj, dict) else None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"{where}: needs 'messages', a list of chat messages")
        system = None
        if messages and messages[0].get("role") == "system":
            system, messages = str(messages[0].get("content", "")), messages[1:]
        users, budgets = [], []
        for k, m in enumerate(messages):
            if m.get("role") != "user":
                continue
            content = m.get("content")
            if not isinstance(content, str) or not content:
                raise ValueError(f"{where}: message {k}: a user message needs non-empty text content")
            reply = messages[k + 1] if k + 1 < len(messages) and messages[k + 1].get("role") == "assistant" else None
            budget = m.get("max_tokens", len(str(reply.get("content", "")).split()) if reply else spec.output_len)
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                raise ValueError(f"{where}: message {k}: max_tokens must be a positive integer, got {budget!r}")
            users.append(content)
            budgets.append(min(max(budget, 1), spec.max_output_len))
        if not users:
            raise ValueError(f"{where}: no user message")
        n = min(len(users), spec.turns)
        out.append(Conversation(len(out), system, tuple(users[:n]), tuple(budgets[:n]), ()))
    if not out:
        raise ValueError(f"{spec.path}: no conversation")
    return out


def _numbered(script: Conversation, index: int, spec: WorkloadSpec, rng: random.Random) -> Conversation:
    return Conversation(index, script.system, script.users, script.max_tokens, _thinks(spec, rng, script.turns))


def _thinks(spec: WorkloadSpec, rng: random.Random, turns: int) -> tuple[float, ...]:
    if spec.think_time_s <= 0:
        return (0.0,) * turns
    return tuple(-spec.think_time_s * math.log(1.0 - rng.random()) for _ in range(turns))
