"""Choices: the SamplingParams of each of n choices (OpenAI's `n`, `best_of`) of one prompt. Torch-free.

Choice j samples with seed (seed + j) mod 2**63 when the request has a seed (vLLM's rule for parallel sampling),
so choice 0 is the request itself, choice j equals a separate request sent with seed + j, and choices differ
(their noise keys differ: engine.sampler.step_seed). Without a seed every choice draws its own random keys.
"""

from __future__ import annotations

from dataclasses import replace

from engine.core.sampling_params import SamplingParams

MAX_CHOICES = 128  # n and best_of, as OpenAI


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded with `seed` (None stays None)."""
    return None if seed is None else (seed + index) % 2**63


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Each choice's params: the request's, with choice_seed(seed, j)."""
    if not 1 <= n <= MAX_CHOICES:
        raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {n}")
    return [params if j == 0 or params.seed is None else replace(params, seed=choice_seed(params.seed, j))
            for j in range(n)]
