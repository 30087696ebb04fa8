"""The C draw of the CPU sampler (engine.cpu_kernels.sampling) against the Sampler's torch ops: the same tokens,
bit for bit, for greedy and random rows mixed, seeded and unseeded, every filter, vocabularies that are and are not
multiples of the vector width, ties, -inf logits; a row with a NaN is left to torch (same result as without the
kernel); bad tensors are refused with a message. Skipped where the kernel cannot run (no AVX-512 or no compiler)."""

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.cpu_kernels import sampling as cpu_sampling
from engine.sampling.sampler import Sampler

pytestmark = pytest.mark.skipif(cpu_sampling.load() is None, reason="the C sampling kernel cannot run here")


def both(logits: torch.Tensor, params: list[SamplingParams], indices: list[int], seed: int) -> tuple:
    """(torch path's tokens, the kernel's tokens) from two Samplers in the same RNG state."""
    plain, fast = Sampler(torch.device("cpu"), seed), Sampler(torch.device("cpu"), seed, cpu_kernel=True)
    assert fast.cpu_kernel and not plain.cpu_kernel
    return plain(logits, params, indices), fast(logits, params, indices)


def random_params(g: torch.Generator, rows: int, vocab: int, filters: bool) -> list[SamplingParams]:
    out = []
    for i in range(rows):
        kind = int(torch.randint(0, 5, (1,), generator=g))
        extra = {}
        if filters:
            extra = [{"top_k": 1 + i % 7}, {"top_p": 0.3 + 0.1 * (i % 6)}, {"min_p": 0.05 * (i % 5)},
                     {"top_k": 50, "top_p": 0.9, "min_p": 0.02}, {}][i % 5]
        out.append(SamplingParams(temperature=0.0 if kind == 0 else float(0.05 + 2 * torch.rand(1, generator=g)),
                                  seed=i if kind == 1 else None, max_tokens=8,
                                  logprobs=2 if kind == 2 and vocab > 2 else None,
                                  **extra))
    return out


@pytest.mark.parametrize("filters", [False, True])
def test_random_and_greedy_rows_draw_the_same_tokens_as_torch(filters, monkeypatch):
    drawn = []  # the kernel's draws (not declined): the comparison is not torch against torch
    real = cpu_sampling.sample_rows
    monkeypatch.setattr(cpu_sampling, "sample_rows", lambda *a: drawn.append(real(*a)) or drawn[-1])
    g = torch.Generator().manual_seed(3 + filters)
    for trial in range(60):
        rows = int(torch.randint(1, 18, (1,), generator=g))
        vocab = [1, 15, 16, 17, 31, 2048, 3001][trial % 7]
        logits = torch.randn(rows, vocab, generator=g) * float(1 + 8 * torch.rand(1, generator=g))
        params = random_params(g, rows, vocab, filters)
        plain, fast = both(logits, params, [trial + i for i in range(rows)], seed=trial)
        assert fast == plain
    assert len(drawn) == 60 and all(t is not None for t in drawn)


def test_greedy_argmax_keeps_the_first_maximum_and_all_minus_inf_rows():
    logits = torch.randn(6, 100)
    logits[0, [7, 40, 99]] = 50.0  # ties: the first
    logits[1] = float("-inf")      # nothing allowed: index 0, as torch
    logits[2, :] = 1.0
    logits[3, 99] = float("inf")
    logits[4, :-1] = float("-inf")
    greedy = [SamplingParams(temperature=0.0, max_tokens=4)] * 6
    plain, fast = both(logits, greedy, [0] * 6, seed=0)
    assert fast == plain and fast[0][:5] == [7, 0, 0, 99, 99]
    assert torch.equal(cpu_sampling.sample_rows(logits, None, None), logits.argmax(dim=-1))


def test_rows_with_a_nan_or_an_infinite_maximum_are_left_to_torch():
    logits = torch.randn(4, 64)
    logits[1, 5] = float("nan")
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=4) for i in range(4)]
    packed = Sampler(torch.device("cpu"))._pack(params, [0] * 4, 64)
    assert cpu_sampling.sample_rows(logits, packed, None) is None
    assert cpu_sampling.sample_rows(logits, None, None) is None  # greedy: torch's argmax picks the NaN
    plain, fast = both(logits, params, [0] * 4, seed=1)
    assert plain == fast
    logits = torch.randn(2, 64)
    logits[0, 3] = float("inf")  # torch: inf - inf is NaN in every weight of the row, and argmax picks index 0
    assert cpu_sampling.sample_rows(logits, packed[:2], None) is None
    plain, fast = both(logits, params[:2], [0, 0], seed=2)
    assert plain == fast


def test_bad_tensors_are_refused_with_a_message():
    logits = torch.randn(2, 10)
    with pytest.raises(ValueError, match="float32"):
        cpu_sampling.sample_rows(logits.double(), None, None)
    with pytest.raises(ValueError, match="packed"):
        cpu_sampling.sample_rows(logits, torch.zeros(2, 5, dtype=torch.int64), None)
    with pytest.raises(ValueError, match="keep"):
        cpu_sampling.sample_rows(logits, None, torch.ones(2, 9, dtype=torch.bool))
