"""Sampler: turns one row of logits per sampling request into a token (and its logprobs).

Filters apply in vLLM's order: temperature, top-k, top-p, min-p. Sampling is an exponential race
(argmax of p / E with E ~ Exp(1), noise indexed by vocabulary id), which draws exactly from p. A seeded
request's noise comes from a generator seeded by (seed, output index) alone, so it is the same in any batch,
after preemption, and on whichever worker samples that token (prefill samples the first, decode the rest).
Reported logprobs are those of the unmodified model distribution (log_softmax of the raw logits).
"""

from __future__ import annotations

import hashlib

import torch

from engine.request import TokenLogprob
from engine.sampling_params import SamplingParams


def step_seed(seed: int, output_index: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{output_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._unseeded = torch.Generator(device=device).manual_seed(seed)  # for requests without a seed

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 output_indices: list[int]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits [S, V] float32, one row per sampling request -> (token ids, logprobs or None per row)."""
        tokens = logits.argmax(dim=-1)  # [S]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            sub = [params[i] for i in random_rows]
            probs = self._filtered_probs(logits[rows], sub)  # [R, V]
            noise = torch.stack([self._noise(p, output_indices[i], logits.shape[1])
                                 for i, p in zip(random_rows, sub, strict=True)])
            tokens[rows] = (probs / noise).argmax(dim=-1)
        token_list = tokens.tolist()
        return token_list, self._logprobs(logits, params, token_list)

    def _filtered_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """logits [R, V] -> probabilities [R, V] after temperature, top-k, top-p and min-p."""
        dev, vocab = logits.device, logits.shape[1]
        temps = torch.tensor([p.temperature for p in params], device=dev)[:, None]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)[:, None]
        top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
        min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
        sorted_logits, order = (logits / temps).sort(dim=-1, descending=True)  # [R, V]
        drop = torch.arange(vocab, device=dev)[None, :] >= top_k
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        drop |= (probs.cumsum(dim=-1) - probs) > top_p  # keeps the first token always
        drop |= probs < min_p * probs[:, :1]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        return torch.zeros_like(probs).scatter_(1, order, probs)

    def _noise(self, p: SamplingParams, output_index: int, vocab: int) -> torch.Tensor:
        """[V] Exp(1) noise for one row."""
        gen = self._unseeded
        if p.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(step_seed(p.seed, output_index))
        return torch.empty(vocab, device=self.device).exponential_(generator=gen)

    @staticmethod
    def _logprobs(logits: torch.Tensor, params: list[SamplingParams],
                  tokens: list[int]) -> list[TokenLogprob | None]:
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[TokenLogprob | None] = [None] * len(params)
        if not wanted:
            return result
        logprobs = logits[wanted].log_softmax(dim=-1)  # [W, V]
        n_top = max(params[i].logprobs or 0 for i in wanted)
        top_vals, top_ids = logprobs.topk(max(n_top, 1), dim=-1)
        chosen = logprobs.gather(1, torch.tensor([[tokens[i]] for i in wanted], device=logits.device))
        top_vals, top_ids, chosen = top_vals.tolist(), top_ids.tolist(), chosen[:, 0].tolist()
        for row, i in enumerate(wanted):
            n = params[i].logprobs or 0
            top = dict(zip(top_ids[row][:n], top_vals[row][:n], strict=True))
            result[i] = TokenLogprob(tokens[i], chosen[row], top)
        return result
