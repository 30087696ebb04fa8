"""Reasoning output kept apart from the answer: `<think>...</think>` models (DeepSeek-R1, QwQ, Qwen3), chat only.

Owns `ReasoningSplit`, one sequence's output text split as it is generated into reasoning and content, with vLLM's
parser names and meanings (`server.reasoning_parser`, vLLM's `--reasoning-parser`; off by default):
- `deepseek_r1`: the chat template opens the thinking (`<think>` ends the generation prompt), so the output is
  reasoning from its first token up to `</think>`, content after it; an output without `</think>` is all reasoning
  (content null). A `<think>` the model writes itself before `</think>` is dropped.
- `qwen3`: reasoning is what follows a `<think>` in the output, up to `</think>` (or the end, when the output was
  cut); text outside the tags is content, so an output without `<think>` (thinking turned off) is all content.
Tags are matched in the text, so they may arrive split over several tokens or deltas: text that may be the beginning
of a tag is held back until the next piece tells (`feed`), and released at the end (`finish`). A streamed response
and a whole one therefore split alike. The count of reasoning tokens (vLLM's `usage.completion_tokens_details.
reasoning_tokens`): every token consumed while the reasoning was open, the tokens that open and close it included.
A request that turns thinking off (`chat_template_kwargs` `enable_thinking: false` or `thinking: false`) is not
split (`for_request` gives None): its output is all content.
"""

from __future__ import annotations

from typing import Any

from coordinator.config.settings import REASONING_PARSERS
from coordinator.errors import invalid_request

START, END = "<think>", "</think>"
FIELDS = ("reasoning", "reasoning_content")  # vLLM's current name, and its name before v0.11 (DeepSeek's API too)


def thinking_off(req: Any) -> bool:
    """Whether the request turns the template's thinking off (then no reasoning is parsed, as vLLM)."""
    kwargs = getattr(req, "chat_template_kwargs", None) or {}
    return kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False


def for_request(parser: str | None, req: Any) -> ReasoningSplit | None:
    """A splitter for one sequence of a chat request, or None when reasoning is not parsed for it."""
    if parser is None or thinking_off(req):
        return None
    return ReasoningSplit(parser)


def fields(reasoning: str | None) -> dict[str, str | None]:
    """The message's (or delta's) reasoning fields, under both names vLLM has used."""
    return dict.fromkeys(FIELDS, reasoning)


class ReasoningSplit:
    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {list(REASONING_PARSERS)}, got {parser!r}")
        self._skip_start = parser == "deepseek_r1"  # a <think> inside the reasoning is dropped
        self.inside = parser == "deepseek_r1"      # in the reasoning now
        self.opened = self.inside                  # the reasoning section began (the message gets `reasoning`)
        self.closed = False                        # </think> seen: the rest is content
        self._held = ""
        self.tokens = 0                            # reasoning tokens so far

    def take_token(self, text: str) -> tuple[str, str]:
        """One generated token's text: (reasoning, content) to send now; counts the token."""
        before = self.inside
        out = self.feed(text)
        self.tokens += before or self.inside
        return out

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that is safe to send after `text`; a possible tag beginning stays back."""
        buf, reasoning, content = self._held + text, [], []
        self._held = ""
        while buf:
            if self.closed:
                content.append(buf)
                break
            tags = [END] + ([START] if self._skip_start else []) if self.inside else [START]
            hits = [(buf.find(t), t) for t in tags if t in buf]
            if hits:
                at, tag = min(hits)
                (reasoning if self.inside else content).append(buf[:at])
                buf = buf[at + len(tag):]
                if tag == END:
                    self.inside, self.closed = False, True
                elif self.inside:
                    self._skip_start = False  # the model's own <think>: dropped once
                else:
                    self.inside = self.opened = True
                continue
            keep = max(_partial(buf, t) for t in tags)
            (reasoning if self.inside else content).append(buf[:len(buf) - keep])
            self._held = buf[len(buf) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The output ended: what was held back, in the part it was in."""
        held, self._held = self._held, ""
        return (held, "") if self.inside else ("", held)


def _partial(buf: str, tag: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


def refuse_constraints(parser: str | None, req: Any) -> None:
    """A 400 naming the field when a chat request with reasoning parsed also constrains its output (a structured
    output, or a tool_choice that forces a call): vLLM constrains only the answer that follows the reasoning; this
    server's grammar would constrain the reasoning too, so it refuses rather than answer differently."""
    if parser is None or thinking_off(req):
        return
    rf = getattr(req, "response_format", None)
    named = (["response_format"] if rf is not None and rf.type != "text" else []) + [
        f for f in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
        if getattr(req, f, None) is not None]
    if getattr(req, "tool_mode", "none") in ("named", "required"):
        named.append("tool_choice")
    if named:
        raise invalid_request(
            f"{named[0]}: cannot be combined with reasoning (server.reasoning_parser is {parser}): the grammar would "
            "constrain the reasoning too; turn thinking off for this request (chat_template_kwargs "
            '{"enable_thinking": false}) to constrain the whole output', named[0])
