"""Sampler: turns one row of logits per sampling request into a token (and its logprobs), entirely on the device.

Filters apply in vLLM's order: temperature, top-k, top-p, min-p. Sampling is an exponential race: the token is
argmax_v w_v / E_v with w the (unnormalised) filtered probabilities and E_v ~ Exp(1), which draws exactly from w.

The noise is counter-based: E for row r and vocabulary id v is a pure function of (key_r, v) (splitmix64 of
key_r + (v + 1) * golden ratio, 52 bits -> u in (0, 1) -> -log u), computed with vectorised integer torch ops that
give the same bits on every device. A seeded request's key is step_seed(seed, output index), so its noise is the
same in any batch, after preemption, and on whichever worker samples that token (prefill samples the first,
decode the rest). Unseeded requests take a key from the Sampler's own Python RNG, so no device generator exists.

Host traffic per call: the per-row parameters go to the device in ONE (non-blocking, pinned) copy, and the results
(tokens, plus chosen and top-N logprobs when any row asks) come back in ONE non-blocking read; `launch` returns at
once with the tokens still on the device (SampledTokens), and only SampledTokens.result() waits for the host copy.
Reported logprobs are those of the unmodified model distribution (log_softmax of the raw logits), as vLLM's default
`logprobs_mode` (raw_logprobs): logit_bias, min_tokens, bad words and penalties (engine.logits_processing, applied
first, and only when some row of the call uses them) change which token is chosen, not the logprobs reported.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from engine.core.request import TokenLogprob
from engine.core.sampling_params import SamplingParams
from engine.cpu_kernels import sampling as cpu_sampling
from engine.sampling.logits_processing import LogitsProcessing, TokenHistory

_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

# Columns of the packed per-row parameter tensor [S, 6] int64; the float columns hold float64 bit patterns.
_KEY, _TOP_K, _GREEDY, _TEMP, _TOP_P, _MIN_P = range(6)


def step_seed(seed: int, output_index: int) -> int:
    """The noise key of a seeded request's output_index-th token, in [0, 2**63)."""
    digest = hashlib.blake2b(f"{seed}:{output_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _signed(c: int) -> int:
    """A 64-bit unsigned constant as the int64 with the same bits."""
    return c - 2**64 if c >= 2**63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic: mask off the copied sign bits)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in place on int64 bit patterns; multiplication wraps modulo 2**64 (two's complement)."""
    z ^= _shr(z, 30)
    z *= _signed(_MIX1)
    z ^= _shr(z, 27)
    z *= _signed(_MIX2)
    z ^= _shr(z, 31)
    return z


def exp_noise(keys: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """keys [R] int64, vocab_ids [V] int64 -> Exp(1) noise [R, V] float32, a pure function of (key, vocabulary id).

    Computed in int64 then float64 (whose log is nearly always correctly rounded) before rounding to float32, so
    CPU and CUDA agree bit for bit (a 1-ulp float64 difference survives the rounding with probability ~2**-29).
    """
    offsets = (vocab_ids + 1) * _signed(_GOLDEN)  # [V], wraps
    z = _mix64(keys[:, None] + offsets[None, :])  # [R, V] 64 random bits
    u = (_shr(z, 12).double() + 0.5) * 2.0**-52  # [R, V] in (0, 1): 52 bits + 0.5 is exact in float64
    return u.log_().neg_().float()  # > 0 always: the smallest is -log(1 - 2**-53) ~ 1.1e-16


@dataclass
class SampledTokens:
    """One sampling call in flight. `tokens` [S] int64 stays on the device (an overlapped next decode step reads
    its input ids from it); the results' host copy is queued behind it, and result() waits for that copy."""

    tokens: torch.Tensor               # [S] int64, on the device
    rows: torch.Tensor                 # [S, 1] int64, or [S, 2 + 2N] float64 with logprobs; host (pinned on CUDA)
    copied: torch.cuda.Event | None    # completes with the host copy (None: already on the host)
    wanted: list[int | None]           # logprobs asked for, per row

    def result(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """(token ids, logprobs or None per row): the call's one host synchronisation."""
        if self.copied is not None:
            self.copied.synchronize()
        rows = self.rows.tolist()
        if self.rows.dtype == torch.int64:
            return [row[0] for row in rows], [None] * len(rows)
        n_top = (len(rows[0]) - 2) // 2 if rows else 0
        result: list[TokenLogprob | None] = []
        for row, n in zip(rows, self.wanted, strict=True):
            if n is None:
                result.append(None)
                continue
            top = {int(i): v for i, v in zip(row[2 + n_top:2 + n_top + n], row[2:2 + n], strict=True)}
            result.append(TokenLogprob(int(row[0]), row[1], top))
        return [int(row[0]) for row in rows], result


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, eos_token_ids: tuple[int, ...] = (),
                 histories: Mapping[str, TokenHistory] | None = None, cpu_kernel: bool = False) -> None:
        """`histories`: the engine's live requests by id, read by penalties and bad words (see LogitsProcessing);
        `eos_token_ids`: what min_tokens bans besides stop_token_ids; `cpu_kernel`: on the CPU, draw with
        engine.cpu_kernels.sampling where it builds here (the same tokens, a sixth of the time)."""
        self.device = torch.device(device)
        self.cpu_kernel = False
        if cpu_kernel and self.device.type == "cpu":
            self.cpu_kernel = cpu_sampling.load() is not None
        self._rng = random.Random(seed)  # keys of requests without a seed: instance state, never torch's RNG
        self._vocab_ids: torch.Tensor | None = None  # [V] int64 on the device, cached
        self.processing = LogitsProcessing(self.device, eos_token_ids, histories)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int],
                 request_ids: Sequence[str] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits [S, V] float32, one row per sampling request -> (token ids, logprobs or None per row)."""
        return self.launch(logits, params, output_indices, request_ids).result()

    def launch(self, logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int],
               request_ids: Sequence[str] | None = None) -> SampledTokens:
        """Queue the sampling of logits [S, V] and the results' copy to the host; does not wait for the device.
        `request_ids` name the rows' requests (needed when a row has penalties or multi-token bad words)."""
        if logits.ndim != 2 or logits.shape[0] != len(params) or len(params) != len(output_indices):
            raise ValueError(f"logits must be [S, V] with S == len(params) == len(output_indices), got logits "
                             f"{tuple(logits.shape)}, {len(params)} params, {len(output_indices)} output_indices")
        logits = logits.float()
        batch = None
        chosen_from = logits  # [S, V]: what the tokens are drawn from; logprobs always read the raw logits
        if any(p.processes_logits for p in params):
            batch = self.processing.prepare(params, output_indices, request_ids, logits.shape[1])
            chosen_from = self.processing.apply(batch, logits)
        if all(p.greedy for p in params):
            tokens = self._argmax(chosen_from)  # [S]
        else:
            tokens = self._sample(chosen_from, params, output_indices)  # [S]
        if batch is not None:
            self.processing.record(batch, tokens)
        rows = self._result_rows(logits, tokens, params)
        wanted = [p.logprobs for p in params]
        if rows.device.type != "cuda":
            return SampledTokens(tokens, rows.cpu(), None, wanted)
        host = rows.to("cpu", non_blocking=True)  # lands in pinned memory
        copied = torch.cuda.Event()
        copied.record()
        return SampledTokens(tokens, host, copied, wanted)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                output_indices: list[int]) -> torch.Tensor:
        """logits [S, V] -> tokens [S] int64; greedy and random rows in one vectorised pass."""
        vocab = logits.shape[1]
        packed = self._pack(params, output_indices, vocab)  # [S, 6] int64 on the device
        floats = scaled = keep = None
        if any(_filters(p, vocab) for p in params):
            floats = packed[:, _TEMP:].view(torch.float64).float()  # [S, 3]: temperature, top_p, min_p
            scaled = logits / floats[:, :1]  # [S, V] (greedy rows carry temperature 1)
            keep = self._keep(scaled, packed[:, _TOP_K:_TOP_K + 1], floats[:, 1:2], floats[:, 2:3])  # [S, V]
        if self.cpu_kernel:  # the rest in one C pass per row (None: a row it leaves to torch's ops)
            tokens = cpu_sampling.sample_rows(logits, packed, keep)
            if tokens is not None:
                return tokens
        if scaled is None:
            floats = packed[:, _TEMP:].view(torch.float64).float()
            scaled = logits / floats[:, :1]
        weights = (scaled - scaled.amax(dim=-1, keepdim=True)).exp_()  # [S, V] unnormalised probabilities
        if keep is not None:
            weights = weights.masked_fill_(~keep, 0.0)
        noise = exp_noise(packed[:, _KEY], self._ids(vocab, logits.device))  # [S, V]
        race = (weights / noise).argmax(dim=-1)  # [S]
        return torch.where(packed[:, _GREEDY].bool(), logits.argmax(dim=-1), race)

    @staticmethod
    def _keep(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
        """scaled logits [S, V], top_k/top_p/min_p [S, 1] -> bool [S, V]: the tokens the filters keep.

        Each filter keeps a prefix of the descending (stable) order, so the first token always survives and ties
        break towards the lower vocabulary id, as argmax does.
        """
        vocab = scaled.shape[1]
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [S, V]
        drop = torch.arange(vocab, device=scaled.device)[None, :] >= top_k  # [S, V]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)  # after top-k, as vLLM
        drop |= (probs.cumsum(dim=-1) - probs) > top_p  # probability mass before the token
        drop |= probs < min_p * probs[:, :1]
        return torch.zeros_like(drop).scatter_(1, order, ~drop)

    def _pack(self, params: list[SamplingParams], output_indices: list[int], vocab: int) -> torch.Tensor:
        """All per-row parameters in one [S, 6] int64 host tensor, sent with one (non-blocking) copy."""
        ints, floats = [], []
        for p, index in zip(params, output_indices, strict=True):
            if p.greedy:
                key = 0
            elif p.seed is not None:
                key = step_seed(p.seed, index)
            else:
                key = self._rng.getrandbits(63)
            top_k = p.top_k if 0 < p.top_k < vocab else vocab
            top_p = p.top_p if p.top_p < 1 else float("inf")  # top_p = 1 keeps everything despite cumsum rounding
            ints.append((key, top_k, int(p.greedy)))
            floats.append((p.temperature if not p.greedy else 1.0, top_p, p.min_p))
        cuda = self.device.type == "cuda"
        host = torch.empty((len(params), 6), dtype=torch.int64, pin_memory=cuda)
        host[:, :_TEMP] = torch.tensor(ints, dtype=torch.int64)
        host[:, _TEMP:].view(torch.float64).copy_(torch.tensor(floats, dtype=torch.float64))
        return host.to(self.device, non_blocking=True) if cuda else host.to(self.device)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """argmax_rows(logits), by the C kernel where this Sampler draws with it (one pass: torch's CPU argmax
        took 47 us for 16 rows of 2,048)."""
        if self.cpu_kernel:
            tokens = cpu_sampling.sample_rows(logits, None, None)
            if tokens is not None:
                return tokens
        return argmax_rows(logits)

    def _ids(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self._vocab_ids is None or self._vocab_ids.shape[0] != vocab or self._vocab_ids.device != device:
            self._vocab_ids = torch.arange(vocab, dtype=torch.int64, device=device)
        return self._vocab_ids

    @staticmethod
    def _result_rows(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Everything the host needs, as one tensor: tokens [S, 1] int64, or with logprobs [S, 2 + 2N] float64
        (token, chosen logprob, top-N logprobs, top-N ids; float64 holds token ids exactly)."""
        if all(p.logprobs is None for p in params):
            return tokens[:, None]
        n_top = max(p.logprobs or 0 for p in params)
        lse = logits.logsumexp(dim=-1, keepdim=True)  # [S, 1]
        top_vals, top_ids = logits.topk(n_top, dim=-1)  # [S, N], sorted descending
        chosen = logits.gather(1, tokens[:, None]) - lse  # [S, 1]
        return torch.cat([tokens[:, None].double(), chosen.double(), (top_vals - lse).double(), top_ids.double()],
                         dim=1)


def _filters(p: SamplingParams, vocab: int) -> bool:
    """Whether a row needs the sorted pass (top-k, top-p or min-p active)."""
    return not p.greedy and (0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, V] float32 -> [S] int64: each row's first maximal index, exactly as argmax(dim=-1). On CUDA by
    engine.kernels.argmax (two launches; torch reduces one row of a 128k vocabulary in a single CUDA block: 28 us on
    an H200, as long as a whole layer of a batch-1 decode step). On the CPU in one pass."""
    if logits.device.type == "cpu":
        return logits.argmax(dim=-1)
    from engine.kernels.argmax import row_argmax  # Triton: imported where a GPU samples

    return row_argmax(logits)
