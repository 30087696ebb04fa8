"""LLM: offline batch generation over an LLMEngine (the vLLM-style entry point for users and tests)."""

from __future__ import annotations

import itertools
from dataclasses import fields, replace

from engine.core.outputs import RequestOutput
from engine.core.request import TokenLogprob
from engine.core.sampling_params import SamplingParams
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.text.detokenizer import IncrementalDetokenizer

_ENGINE_KEYS = {f.name for f in fields(EngineConfig)}


class LLM:
    """LLM(model="tiny" | path, dtype=..., device=..., block_size=..., max_num_seqs=...,
    max_num_batched_tokens=..., enable_prefix_caching=..., ...): see EngineConfig for every keyword."""

    def __init__(self, model: str = "tiny", **engine_kwargs) -> None:
        unknown = set(engine_kwargs) - _ENGINE_KEYS
        if unknown:
            raise TypeError(f"LLM() got unknown keyword(s) {sorted(unknown)}; known: {sorted(_ENGINE_KEYS)}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self.engine.wait_for_host_tier()  # offline: every request finds the tier (a server's joins when built)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def chat(self, conversations: list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate a reply to each conversation (a list of {"role", "content"} messages) via the chat template.
        The template writes the special tokens itself, so the text is encoded without adding more."""
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        outputs = self.generate(ids, sampling_params)
        return [replace(o, prompt=t) for o, t in zip(outputs, texts, strict=True)]

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        encoded = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        logprobs: dict[str, list[TokenLogprob]] = {rid: [] for rid in ids}
        finish: dict[str, str] = {}
        try:
            for rid, prompt, p in zip(ids, encoded, params, strict=True):
                self.engine.add_request(rid, prompt, p)
            while self.engine.has_unfinished():
                self.engine.capture_deferred_graph(busy=True)  # graph_capture "deferred": now and then, one
                for out in self.engine.step():
                    tokens[out.request_id] += out.new_token_ids
                    logprobs[out.request_id] += out.new_logprobs
                    if out.finish_reason is not None:
                        finish[out.request_id] = out.finish_reason
        finally:
            for rid in ids:
                if rid not in finish:
                    self.engine.abort(rid)
        return [
            RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids_, tokens[rid],
                          self._text(ids_, tokens[rid]), finish[rid],
                          logprobs[rid] if p.logprobs is not None else None)
            for rid, prompt, ids_, p in zip(ids, prompts, encoded, params, strict=True)
        ]

    def _text(self, prompt_ids: list[int], output_ids: list[int]) -> str:
        """The output's text as a server streams it: decoded after the prompt's last tokens (a character the
        prompt's last token began and the first output token completes is the prompt's, not the output's)."""
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        return detokenizer.step(output_ids) + detokenizer.flush()
