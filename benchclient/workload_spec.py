"""WorkloadSpec: the frozen description of a benchmark workload, checked at construction, and how its lengths are
drawn (`draw_lengths`) from the words synthetic prompts are made of (`WORDS`).

What the request builders share (benchclient.workload builds single requests from a spec, benchclient.conversations
multi-turn conversations), so that neither imports the other's module for it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields

KINDS = ("fixed", "uniform", "chat", "jsonl", "sharegpt", "multiturn")
PROMPT_FORMATS = ("text", "ids")
WORDS = tuple("""the of and to in is you that it he was for on are as with his they at be this have from or one
had by word but not what all were we when your can said there use an each which she do how their if will up
other about out many then them these so some her would make like him into time has look two more write go see
number no way could people my than first water been call who oil its now find long down day did get come made may
part over new sound take only little work know place year live me back give most very after thing our just name
good sentence man think say great where help through much before line right too mean old any same tell boy follow
came want show also around form three small set put end does another well large must big even such because turn
here why ask went men read need land different home us move try kind hand picture again change off play spell
air away animal house point page letter mother answer found study still learn should world high""".split())


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload. Lengths are in tokens (words for `text` prompts); `chat` draws both from log-normals
    (median `input_len` / `output_len`, spread `sigma`), clipped to [`min_len`, `max_input_len` / `max_output_len`]:
    most requests short, a few very long, like chat traffic. `multiturn`: `conversations` conversations of `turns`
    turns, each turn's new user message and output drawn as `chat` draws them, `think_time_s` (mean, exponential)
    between a reply and the next turn, a shared system prompt of `system_prompt_len` words (0: none); with `path`,
    the conversations of a jsonl file (benchclient.conversations)."""

    name: str = "default"
    kind: str = "fixed"
    input_len: int = 128
    output_len: int = 64
    min_len: int = 1              # `uniform`: lengths in [min_len, input_len] and [min_len, output_len]
    max_input_len: int = 4096     # `chat` and files: longer prompts are clipped / skipped
    max_output_len: int = 1024
    sigma: float = 1.0
    path: str | None = None       # `jsonl` / `sharegpt`
    prompt_format: str = "text"   # "text" | "ids" (ids: synthetic kinds but multiturn)
    seed: int = 0
    conversations: int = 100      # `multiturn`: conversations in the run ...
    turns: int = 4                # ... turns of each (a file's: at most this many)
    think_time_s: float = 0.0     # ... mean pause between a reply and the next turn (exponential; 0: none)
    system_prompt_len: int = 0    # ... words of one system prompt shared by every conversation (0: none)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {self.prompt_format!r}")
        for name in ("input_len", "output_len", "min_len", "max_input_len", "max_output_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.kind == "uniform" and self.min_len > min(self.input_len, self.output_len):
            raise ValueError(f"min_len ({self.min_len}) must not exceed input_len and output_len")
        if self.kind in ("jsonl", "sharegpt") and not self.path:
            raise ValueError(f"kind {self.kind!r} needs a path")
        if self.kind in ("jsonl", "sharegpt", "multiturn") and self.prompt_format == "ids":
            raise ValueError("prompt_format 'ids' is for synthetic single-turn kinds; files and conversations hold "
                             "text")
        for name in ("conversations", "turns"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.system_prompt_len, bool) or not isinstance(self.system_prompt_len, int) \
                or self.system_prompt_len < 0:
            raise ValueError(f"system_prompt_len must be an integer >= 0, got {self.system_prompt_len!r}")
        think = self.think_time_s
        if isinstance(think, bool) or not isinstance(think, (int, float)) or not 0 <= think <= 3600:
            raise ValueError(f"think_time_s must be a number of seconds in [0, 3600], got {think!r}")
        if not self.sigma > 0:
            raise ValueError(f"sigma must be positive, got {self.sigma!r}")

    @classmethod
    def from_dict(cls, raw: dict) -> WorkloadSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r}; known keys: {sorted(known)}")
        return cls(**raw)


def draw_lengths(spec: WorkloadSpec, rng: random.Random) -> tuple[int, int]:
    """(input, output) lengths of one request (of one turn's new message, for `multiturn`: drawn as `chat`)."""
    if spec.kind == "fixed":
        return spec.input_len, spec.output_len
    if spec.kind == "uniform":
        return rng.randint(spec.min_len, spec.input_len), rng.randint(spec.min_len, spec.output_len)
    lin = round(math.exp(rng.gauss(math.log(spec.input_len), spec.sigma)))
    lout = round(math.exp(rng.gauss(math.log(spec.output_len), spec.sigma)))
    return (min(max(lin, spec.min_len), spec.max_input_len), min(max(lout, spec.min_len), spec.max_output_len))
