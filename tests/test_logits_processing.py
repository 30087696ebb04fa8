"""Penalties, logit_bias, min_tokens and bad words in the sampler, against a float64 reference written here: the
processed logits, greedy and seeded tokens, rows without any of it untouched, state across steps (also when the
host lags a step behind, as under overlapped scheduling), resumed requests, slot reuse, raw logprobs."""

from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.sampling.sampler import Sampler, exp_noise, step_seed

V = 64
EOS = (3,)
PROMPT = [5, 6, 7, 5, 9]


@dataclass
class History:
    prompt_token_ids: list[int]
    all_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = self.all_token_ids or list(self.prompt_token_ids)

    @property
    def outputs(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]


def reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], outputs: list[int]) -> torch.Tensor:
    """vLLM's logits processing of one row, in float64, written from its definitions."""
    x = logits.double().clone()
    for t, b in p.logit_bias:
        x[t] += b
    if len(outputs) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(EOS)):
            x[t] = float("-inf")
    for word in p.bad_words_token_ids:
        prefix = list(word[:-1])
        if len(prefix) <= len(outputs) and outputs[len(outputs) - len(prefix):] == prefix:
            x[word[-1]] = float("-inf")
    for t in set(prompt) | set(outputs):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(outputs).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def reference_token(x: torch.Tensor, p: SamplingParams, k: int) -> int:
    """The token the sampler must draw from reference logits x (no top-k/p filters): argmax, or the seeded race."""
    if p.greedy:
        return int(x.argmax())
    noise = exp_noise(torch.tensor([step_seed(p.seed, k)]), torch.arange(V))[0].double()
    weights = ((x - x.max()) / p.temperature).exp()
    return int((weights / noise).argmax())


CASES = {
    "presence": SamplingParams(temperature=0, presence_penalty=1.5, max_tokens=64),
    "frequency": SamplingParams(temperature=0, frequency_penalty=1.2, max_tokens=64),
    "negative": SamplingParams(temperature=0, presence_penalty=-0.5, frequency_penalty=-0.3, max_tokens=64),
    "repetition": SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=64),
    "bias": SamplingParams(temperature=0, logit_bias={11: 5.0, 3: -100, 40: 1.0}, max_tokens=64),
    "min_tokens": SamplingParams(temperature=0, min_tokens=4, stop_token_ids=(8,), max_tokens=64),
    "bad_words": SamplingParams(temperature=0, bad_words_token_ids=((20,), (8, 3), (3, 8, 34)), max_tokens=64),
    "combined": SamplingParams(temperature=0, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3,
                               logit_bias={2: 3.0}, min_tokens=3, bad_words_token_ids=((9, 10),), max_tokens=64),
    "seeded": SamplingParams(temperature=0.8, seed=11, presence_penalty=0.8, frequency_penalty=0.5,
                             repetition_penalty=1.2, logit_bias={4: 1.5}, min_tokens=2, max_tokens=64),
}


def _logits(steps: int, rows: int, seed: int) -> torch.Tensor:
    """[steps, rows, V]: EOS, stop token 8, bad words' last tokens and prompt tokens made attractive, and the same
    tokens lead every step, so every kind of processing changes some choices (asserted)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(V, generator=gen) + torch.randn(steps, rows, V, generator=gen) * 0.5  # the same tokens lead
    x[..., [10, 20, 31, 34, 5, 7]] += 2.5
    x[..., [3, 8]] += 4.0
    return x


def _run(sampler: Sampler, histories: dict, logits: torch.Tensor, params: list[SamplingParams], lag: bool):
    """Sample `steps` tokens for every row; with `lag`, the host learns each token one step late (as when a
    decode step is queued before the previous one's tokens are read). Returns tokens [rows][steps]."""
    rids = [f"r{i}" for i in range(len(params))]
    pending: list[int] | None = None
    out: list[list[int]] = [[] for _ in params]
    base = [len(histories[r].outputs) for r in rids]
    for step in range(logits.shape[0]):
        k = [b + step for b in base]
        tokens, _ = sampler(logits[step], params, k, rids)
        if pending is not None:
            for r, t in zip(rids, pending, strict=True):
                histories[r].all_token_ids.append(t)
        pending = tokens
        if not lag:
            for r, t in zip(rids, tokens, strict=True):
                histories[r].all_token_ids.append(t)
            pending = None
        for i, t in enumerate(tokens):
            out[i].append(t)
    return out


@pytest.mark.parametrize("lag", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_parameter_exactly_as_the_float64_reference(name, lag):
    p = CASES[name]
    steps = 12
    logits = _logits(steps, 1, seed=sorted(CASES).index(name))
    histories = {"r0": History(list(PROMPT))}
    sampler = Sampler(torch.device("cpu"), eos_token_ids=EOS, histories=histories)
    outputs: list[int] = []
    for step in range(steps):
        batch = sampler.processing.prepare([p], [step], ["r0"], V)
        got = sampler.processing.apply(batch, logits[step])[0]
        want = reference(logits[step, 0], p, PROMPT, outputs)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        finite = ~torch.isinf(want)
        torch.testing.assert_close(got[finite].double(), want[finite], rtol=1e-6, atol=1e-5)
        token = reference_token(want, p, step)
        outputs.append(token)
        histories["r0"].all_token_ids.append(token)  # prepare() alone: the slot catches up from the host
    raw = [reference_token(logits[s, 0].double(), p, s) for s in range(steps)]
    assert outputs != raw  # the processing changed some choices
    # the same, through the sampler proper, with the host possibly one token behind
    histories = {"r0": History(list(PROMPT))}
    fresh = Sampler(torch.device("cpu"), eos_token_ids=EOS, histories=histories)
    assert _run(fresh, histories, logits, [p], lag) == [outputs]


def test_a_mixed_batch_gives_each_row_its_own_tokens_and_leaves_plain_rows_untouched():
    params = [SamplingParams(temperature=0), CASES["combined"], SamplingParams(temperature=0.9, seed=3),
              CASES["seeded"], CASES["bad_words"]]
    logits = _logits(10, len(params), seed=7)
    mixed = {f"r{i}": History(list(PROMPT)) for i in range(len(params))}
    together = _run(Sampler(torch.device("cpu"), eos_token_ids=EOS, histories=mixed), mixed, logits, params, True)
    for i, p in enumerate(params):
        alone_h = {"r0": History(list(PROMPT))}
        alone = _run(Sampler(torch.device("cpu"), eos_token_ids=EOS, histories=alone_h), alone_h,
                     logits[:, i:i + 1], [p], False)
        assert together[i] == alone[0], f"row {i}"
    plain = Sampler(torch.device("cpu"))  # no histories at all: the plain rows never reach the processing
    assert [plain(logits[s, :1], [params[0]], [s])[0][0] for s in range(10)] == together[0]


def test_penalties_count_the_prior_outputs_of_a_resumed_request():
    p = CASES["combined"]
    logits = _logits(12, 1, seed=5)
    h = {"r0": History(list(PROMPT))}
    full = _run(Sampler(torch.device("cpu"), eos_token_ids=EOS, histories=h), h, logits, [p], False)[0]
    resumed = {"r0": History(list(PROMPT), list(PROMPT) + full[:5])}
    rest = _run(Sampler(torch.device("cpu"), eos_token_ids=EOS, histories=resumed), resumed, logits[5:], [p], True)
    assert rest[0] == full[5:]


def test_a_slot_is_not_inherited_by_a_new_request_under_the_same_id():
    p = CASES["frequency"]
    logits = _logits(6, 1, seed=9)
    h = {"r0": History(list(PROMPT))}
    sampler = Sampler(torch.device("cpu"), eos_token_ids=EOS, histories=h)
    first = _run(sampler, h, logits, [p], False)[0]
    h["r0"] = History(list(PROMPT), list(PROMPT) + [first[0]] * 2)  # a new request object, 2 prior outputs
    fresh_h = {"r0": History(list(PROMPT), list(PROMPT) + [first[0]] * 2)}
    again = _run(sampler, h, logits, [p], True)[0]
    assert again == _run(Sampler(torch.device("cpu"), eos_token_ids=EOS, histories=fresh_h), fresh_h, logits,
                         [p], False)[0]
    assert sampler.processing.num_slots == 1


def test_logprobs_stay_those_of_the_raw_logits():
    p = SamplingParams(temperature=0, logit_bias={17: 100}, logprobs=2)
    logits = _logits(1, 1, seed=1)[0]
    (token,), (lp,) = Sampler(torch.device("cpu"))(logits, [p], [0])
    assert token == 17
    assert lp.logprob == pytest.approx(float(logits[0].log_softmax(-1)[17]), abs=1e-6)
    assert set(lp.top_logprobs) == set(logits[0].topk(2).indices.tolist())


def test_penalties_without_the_requests_tokens_are_refused_not_ignored():
    with pytest.raises(ValueError, match="request_ids"):
        Sampler(torch.device("cpu"))(_logits(1, 1, 0)[0], [CASES["presence"]], [0])


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"logit_bias": {1: 100.5}}, "logit_bias"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"), ({"min_tokens": 17}, "min_tokens"),
    ({"bad_words_token_ids": ((),)}, "bad_words_token_ids"),
    ({"bad_words_token_ids": (tuple(range(33)),)}, "bad_words_token_ids"),
])
def test_bad_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**kwargs)
