"""The sampler on its own: greedy, exact filtered distributions, counter-based noise, reproducible seeds, logprobs.

Every test runs on the CPU; with CUDA the device-parametrised ones also run there, plus a CPU/CUDA agreement check
at a real vocabulary size and a check that launch() never synchronises with the host (result() waits).
"""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch

from engine.core.request import TokenLogprob
from engine.core.sampling_params import SamplingParams
from engine.kernels.argmax import CHUNK, row_argmax
from engine.sampling.sampler import Sampler, argmax_rows, exp_noise, step_seed

pytestmark = pytest.mark.gpu  # runs its GPU path on a CUDA device when there is one (tests/conftest.py)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MASK64 = 2**64 - 1


def chi2_limit(dof: int) -> float:
    """Upper 0.1% point of the chi-square distribution (Wilson-Hilferty; within 1% for dof >= 1)."""
    z, a = 3.0902, 2 / (9 * dof)
    return dof * (1 - a + z * math.sqrt(a)) ** 3


def chi2(tokens: list[int], expected: list[float]) -> tuple[float, int]:
    """Pearson's statistic of token counts against `expected` probabilities over its support, and the dof."""
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(expected)).tolist()
    support = [i for i, p in enumerate(expected) if p > 0]
    assert all(counts[i] == 0 for i, p in enumerate(expected) if p == 0), (counts, expected)  # filtered: never
    stat = sum((counts[i] - n * expected[i]) ** 2 / (n * expected[i]) for i in support)
    return stat, len(support) - 1


def filtered(probs: list[float], temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
             min_p: float = 0.0) -> list[float]:
    """Plain-Python reference of the filters, in vLLM's order, on probabilities (float64)."""
    w = [p ** (1 / temperature) for p in probs]
    order = sorted(range(len(w)), key=lambda i: -w[i])
    keep = order[:top_k] if top_k > 0 else order
    total = sum(w[i] for i in keep)
    q = {i: w[i] / total for i in keep}
    mass, nucleus = 0.0, []
    for i in keep:
        if mass <= top_p:
            nucleus.append(i)
        mass += q[i]
    kept = [i for i in nucleus if q[i] >= min_p * q[keep[0]]]
    total = sum(q[i] for i in kept)
    return [q[i] / total if i in kept else 0.0 for i in range(len(w))]


def splitmix_exp(key: int, v: int) -> float:
    """Reference of the noise in Python's unbounded integers."""
    z = (key + (v + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return -math.log(((z >> 12) + 0.5) * 2.0**-52)


def test_noise_is_splitmix64_bit_for_bit():
    keys = [0, 1, 2**63 - 1, 2**62 + 12345, step_seed(5, 7), step_seed(2**63 - 1, 10**9)]
    ids = [0, 1, 2, 1000, 2**20, 151_935]
    got = exp_noise(torch.tensor(keys), torch.tensor(ids))  # [6, 6]
    ref = torch.tensor([[splitmix_exp(k, v) for v in ids] for k in keys], dtype=torch.float64).float()
    assert torch.equal(got, ref)
    assert got.dtype == torch.float32 and bool((got > 0).all())


@pytest.mark.parametrize("keys", ["consecutive", "step_seed"])
def test_noise_is_uniform_and_uncorrelated(keys):
    rows = torch.arange(256) if keys == "consecutive" else torch.tensor([step_seed(3, i) for i in range(256)])
    noise = exp_noise(rows, torch.arange(4096)).double()  # [256, 4096]
    n = noise.numel()
    assert abs(noise.mean().item() - 1) < 5 / math.sqrt(n)  # Exp(1): mean 1, sd 1
    u = torch.exp(-noise)  # uniform on (0, 1) if the noise is Exp(1)
    counts = torch.histc(u, bins=64, min=0, max=1)
    stat = ((counts - n / 64) ** 2 / (n / 64)).sum().item()
    assert stat < chi2_limit(63), stat
    limit = 5 / math.sqrt(n)  # a correlation of independent variables has sd 1/sqrt(n)
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):  # adjacent vocabulary ids, adjacent keys
        a, b = a.flatten() - 0.5, b.flatten() - 0.5
        corr = (a * b).mean() / (a.std() * b.std())
        assert abs(corr.item()) < limit


@pytest.mark.parametrize("seeded", [True, False])
def test_a_vocabulary_of_two_is_a_fair_coin(seeded):
    n = 20000
    sampler = Sampler(torch.device("cpu"), seed=1)
    p = SamplingParams(seed=42 if seeded else None)
    tokens = sampler(torch.zeros(n, 2), [p] * n, list(range(n)))[0]
    heads = sum(tokens)
    assert abs(heads - n / 2) < 4.5 * math.sqrt(n) / 2
    same = sum(a == b for a, b in zip(tokens, tokens[1:], strict=False))  # consecutive output indices
    assert abs(same - (n - 1) / 2) < 4.5 * math.sqrt(n - 1) / 2
    many_seeds = [SamplingParams(seed=s) for s in range(n)]  # adjacent seeds, same output index
    heads = sum(sampler(torch.zeros(n, 2), many_seeds, [0] * n)[0])
    assert abs(heads - n / 2) < 4.5 * math.sqrt(n) / 2


PROBS = [0.5, 0.25, 0.15, 0.06, 0.04]
FILTERS = [{}, {"top_k": 2}, {"top_p": 0.8}, {"min_p": 0.2}, {"temperature": 2.0}, {"temperature": 0.5},
           {"temperature": 2.0, "top_k": 3}, {"top_k": 4, "top_p": 0.7, "min_p": 0.3}]


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("kw", FILTERS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_samples_follow_the_filtered_distribution(kw, seeded):
    n = 20000
    sampler = Sampler(torch.device("cpu"), seed=0)
    p = SamplingParams(seed=7 if seeded else None, **kw)
    logits = torch.tensor(PROBS).log()[None, :].expand(n, -1)  # one row, n output indices, one call
    tokens, _ = sampler(logits, [p] * n, list(range(n)))
    stat, dof = chi2(tokens, filtered(PROBS, **kw))
    if dof:
        assert stat < chi2_limit(dof), (stat, dof)


def test_the_chi_square_check_can_fail():
    n = 20000
    tokens = Sampler(torch.device("cpu"))(torch.tensor(PROBS).log()[None, :].expand(n, -1),
                                          [SamplingParams(temperature=1.2)] * n, list(range(n)))[0]
    stat, dof = chi2(tokens, filtered(PROBS))  # right support, slightly wrong temperature
    assert stat > chi2_limit(dof)
    assert filtered(PROBS, top_p=0.8) == pytest.approx([0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0, 0])
    assert filtered(PROBS, min_p=0.2) == pytest.approx([0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0, 0])
    assert filtered(PROBS, top_k=2) == pytest.approx([2 / 3, 1 / 3, 0, 0, 0])


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 1000, generator=gen)
    logits[3, [10, 500]] = 50.0  # a tie: the lower id wins, as argmax
    sampler = Sampler(torch.device(device))
    greedy = SamplingParams(temperature=0)
    tokens, logprobs = sampler(logits.to(device), [greedy] * 32, list(range(32)))
    assert tokens == logits.argmax(-1).tolist() and tokens[3] == 10 and logprobs == [None] * 32
    mixed = [greedy if i % 2 else SamplingParams(temperature=1.0, top_k=50) for i in range(32)]
    tokens, _ = sampler(logits.to(device), mixed, list(range(32)))
    assert tokens[1::2] == logits.argmax(-1).tolist()[1::2]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [128256, 2 * CHUNK, CHUNK + 1, 997, 1])
def test_argmax_rows_is_argmax_with_ties_across_and_within_chunks(device, vocab):
    """The two-launch kernel (32 chunks of 4,096 at Llama 3's vocabulary; a last chunk of one entry) against torch's
    argmax, on the CPU under Triton's interpreter too: ties across and within chunks, NaN (larger than any number:
    the first NaN wins), -inf rows, a strided row view."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=gen)
    if vocab > 2 * CHUNK:
        logits[0, [9000, CHUNK + 5, 130]] = 9.0  # tie across chunks: 130 wins
        logits[1, [2010, 2008]] = 9.0  # tie within a chunk: 2008 wins
        logits[2, -1] = 9.0  # the very last id
        logits[3, [CHUNK * 3 + 1, CHUNK + 7]] = float("nan")  # the first NaN, past a larger number
        logits[3, 5] = float("inf")
    logits[4] = float("-inf")  # every id -inf: 0
    logits[5, -1] = float("nan")
    logits = logits.to(device)
    expected = logits.argmax(-1).tolist()
    assert argmax_rows(logits).tolist() == expected
    if vocab > 2 * CHUNK:
        assert expected[:4] == [130, 2008, vocab - 1, CHUNK + 7]
    if device == "cpu" and torch.cuda.is_available():
        return  # the kernel runs on CPU tensors only under the interpreter (CPU CI)
    assert row_argmax(logits).tolist() == expected
    assert row_argmax(logits[1::2]).tolist() == expected[1::2]  # rows two apart
    with pytest.raises(ValueError, match="logits"):
        row_argmax(logits.double())


@pytest.mark.parametrize("device", DEVICES)
def test_filters_that_leave_one_token_equal_greedy(device):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 500, generator=gen) * 3
    logits[5, [7, 300]] = 40.0  # a tied maximum: top-k and top-p keep the lower id, as argmax does
    sampler = Sampler(torch.device(device))
    argmax = logits.argmax(-1).tolist()
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        tokens, _ = sampler(logits.to(device), [SamplingParams(temperature=1.5, **kw)] * 64, list(range(64)))
        if "min_p" in kw:  # min-p keeps every token as likely as the most likely one: both tied tokens
            assert tokens[5] in (7, 300)
            tokens[5] = argmax[5]
        assert tokens == argmax, kw


SEEDED = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.7, top_k=20, seed=2),
          SamplingParams(temperature=1.3, top_p=0.9, seed=3), SamplingParams(temperature=1.0, min_p=0.05, seed=4),
          SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.01, seed=2**63 - 1, logprobs=3)]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_are_the_same_in_any_batch_order_and_sampler(device):
    vocab, steps = 1000, 16
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(len(SEEDED), vocab, generator=gen) * 2  # each request's logits
    dev = torch.device(device)
    alone = [[Sampler(dev)(rows[i:i + 1].to(device), [p], [k])[0][0] for k in range(steps)]
             for i, p in enumerate(SEEDED)]  # rows without filters take the temperature-only fast path here
    assert all(len(set(t)) > 1 for t in alone)  # really random across output indices

    noise_rows = torch.randn(4, vocab, generator=gen)
    others = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(top_k=5),
              SamplingParams(temperature=0.5, seed=9, logprobs=2)]
    for attempt, sampler in enumerate((Sampler(dev, seed=0), Sampler(dev, seed=123))):
        order = list(range(len(SEEDED) + len(others)))
        random.Random(attempt).shuffle(order)
        for k in range(steps):
            batch = torch.cat([rows, noise_rows])[order].to(device)
            params = [(SEEDED + others)[j] for j in order]
            indices = [k if j < len(SEEDED) else 3 * k + j for j in order]
            tokens = sampler(batch, params, indices)[0]
            for pos, j in enumerate(order):
                if j < len(SEEDED):
                    assert tokens[pos] == alone[j][k], (j, k)

    other_seed = [Sampler(dev)(rows[:1].to(device), [SamplingParams(seed=1001)], [k])[0][0] for k in range(steps)]
    assert other_seed != alone[0]


def test_unseeded_rows_follow_the_samplers_own_seed_and_leave_torchs_rng_alone():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 200, generator=gen)
    params = [SamplingParams(temperature=1.0)] * 8

    def run(seed):
        sampler = Sampler(torch.device("cpu"), seed=seed)
        return [sampler(logits, params, [0] * 8)[0] for _ in range(4)]

    state = torch.random.get_rng_state()
    first = run(7)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert run(7) == first and run(8) != first
    assert len({tuple(t) for t in first}) == 4  # a fresh key each call


def check_logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int],
                   logprobs: list[TokenLogprob | None]) -> None:
    ref = logits.double().log_softmax(-1)  # [S, V]
    for row, (p, token, lp) in enumerate(zip(params, tokens, logprobs, strict=True)):
        if p.logprobs is None:
            assert lp is None
            continue
        assert lp.token_id == token and abs(lp.logprob - ref[row, token].item()) < 1e-5
        top_vals, top_ids = ref[row].topk(p.logprobs)
        assert list(lp.top_logprobs) == top_ids.tolist()
        values = list(lp.top_logprobs.values())
        assert values == sorted(values, reverse=True)
        assert all(abs(a - b) < 1e-5 for a, b in zip(values, top_vals.tolist(), strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_the_raw_model_distribution(device):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(7, 300, generator=gen) * 4
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0.3, logprobs=0),
              SamplingParams(temperature=1.5, top_k=3, seed=1, logprobs=20), SamplingParams(logprobs=None),
              SamplingParams(top_p=0.5, logprobs=1), SamplingParams(temperature=0), SamplingParams(min_p=0.5,
                                                                                                 logprobs=7)]
    tokens, logprobs = Sampler(torch.device(device))(logits.to(device), params, list(range(7)))
    check_logprobs(logits, params, tokens, logprobs)
    greedy = [SamplingParams(temperature=0, logprobs=2)] * 7  # the all-greedy path reads logprobs too
    tokens, logprobs = Sampler(torch.device(device))(logits.to(device), greedy, list(range(7)))
    assert tokens == logits.argmax(-1).tolist()
    check_logprobs(logits, greedy, tokens, logprobs)


@pytest.mark.parametrize("device", DEVICES)
def test_a_mixed_batch_in_one_call(device):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 400, generator=gen) * 3
    dev = torch.device(device)
    params = [SamplingParams(temperature=0), SEEDED[1], SamplingParams(top_k=3), SEEDED[4],
              SamplingParams(temperature=0, logprobs=4), SamplingParams(temperature=0.8, logprobs=2),
              SEEDED[0], SamplingParams(top_p=0.3, min_p=0.1)]
    indices = [0, 5, 1, 9, 2, 3, 11, 4]
    tokens, logprobs = Sampler(dev, seed=5)(logits.to(device), params, indices)
    argmax = logits.argmax(-1).tolist()
    assert tokens[0] == argmax[0] and tokens[4] == argmax[4]
    for row in (1, 3, 6):
        assert tokens[row] == Sampler(dev, seed=99)(logits[row:row + 1].to(device), [params[row]],
                                                    [indices[row]])[0][0]
    assert tokens[2] in logits[2].topk(3).indices.tolist()
    check_logprobs(logits, params, tokens, logprobs)
    assert Sampler(dev)(logits[:0].to(device), [], []) == ([], [])
    with pytest.raises(ValueError, match="output_indices"):
        Sampler(dev)(logits.to(device), params, indices[:3])


if torch.cuda.is_available():

    def test_cpu_and_cuda_draw_the_same_tokens_at_a_real_vocabulary_size():
        vocab, n = 128_256, 48
        gen = torch.Generator().manual_seed(6)
        logits = torch.randn(n, vocab, generator=gen) * 2
        params = [SEEDED[i % len(SEEDED)] for i in range(n)]
        indices = list(range(n))
        cpu = Sampler(torch.device("cpu"))(logits, params, indices)[0]
        gpu = Sampler(torch.device("cuda"))(logits.cuda(), params, indices)[0]
        assert cpu == gpu
        keys = torch.tensor([step_seed(1, i) for i in range(n)])
        ids = torch.arange(vocab)
        assert torch.equal(exp_noise(keys, ids), exp_noise(keys.cuda(), ids.cuda()).cpu())

    def test_launch_never_synchronises_and_result_waits_once():
        gen = torch.Generator().manual_seed(7)
        logits = torch.randn(16, 32_000, generator=gen).cuda()
        params = [SamplingParams(temperature=0), SEEDED[2], SamplingParams(top_k=5, logprobs=3), SEEDED[4]] * 4
        sampler = Sampler(torch.device("cuda"))
        sampler(logits, params, list(range(16)))  # warm up caches
        greedy = logits.argmax(dim=-1).tolist()
        torch.cuda.synchronize()
        for batch in (params, [SamplingParams(temperature=0)] * 16, [SamplingParams(temperature=0.9)] * 16):
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as at_launch:
                    warnings.simplefilter("always")
                    torch.cuda._sleep(50_000_000)  # keep the GPU busy: a hidden wait would show as a warning
                    pending = sampler.launch(logits, batch, list(range(16)))
                with warnings.catch_warnings(record=True) as at_result:
                    warnings.simplefilter("always")
                    tokens, logprobs = pending.result()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert not [str(w.message) for w in at_launch if "synchroniz" in str(w.message)]
            assert len([w for w in at_result if "synchroniz" in str(w.message)]) <= 1  # the copy's event
            if batch[0].greedy:
                assert tokens[0::4] == greedy[0::4] and len(logprobs) == 16
