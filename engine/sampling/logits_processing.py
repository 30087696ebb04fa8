"""LogitsProcessing: the sampling parameters that bend a batch's logits before sampling, applied on the device.

Owns, in vLLM's order: logit_bias (added), min_tokens (EOS and stop_token_ids banned until enough outputs), bad
words (a word's last token banned where the outputs end with the rest of it), then the penalties over the request's
own tokens: repetition (prompt and outputs; positive logits divided, others multiplied), frequency (times each
output's count), presence (once per distinct output). Also the per-request device state the penalties and bad
words read, one slot per request in three slabs: output-token counts [C, V] int32, prompt-token presence [C, V]
bool, and the last W outputs [C, W] int64 (W = MAX_BAD_WORD_TOKENS - 1).

The state is exact under overlapped scheduling: record() counts each sampled token into its slot on the device,
in stream order, right after sampling, so a step queued before the host has read the previous step's tokens
(whose input is a placeholder) still sees every output. The host only remembers how many outputs a slot holds
(`counted`); a slot behind its request (a request just added, resumed with prior outputs, or started on the decode
side from the prefill's first token) catches up from the request's host-side tokens, which then exist. A slot
belongs to one Request object; one whose request is gone (finished, aborted, or replaced under the same id) is
freed at the next prepare(). Rows that use none of this cost nothing: the sampler skips the whole path.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.core.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams

TAIL = MAX_BAD_WORD_TOKENS - 1  # outputs kept per slot for bad-word prefixes
NO_TOKEN = -1                   # tail padding before the first output
ANY = -2                        # a bad word's prefix padding: matches anything


class TokenHistory(Protocol):
    """What the state reads of a request (engine.request.Request has it): the prompt, then prompt + outputs."""

    prompt_token_ids: list[int]
    all_token_ids: list[int]


@dataclass
class _Slot:
    index: int
    owner: TokenHistory
    counted: int  # outputs held in the slot's counts and tail


@dataclass
class ProcessingBatch:
    """One sampling call's processing, as device tensors (index tensors int64)."""

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None     # rows [B], ids [B], biases [B] float32
    banned: tuple[torch.Tensor, torch.Tensor] | None                 # rows [N], ids [N]: -inf
    words: tuple[torch.Tensor, ...] | None  # rows [P], slots [P], prefix [P, TAIL] (ANY on the left), last [P]
    rows: torch.Tensor | None        # [R] batch rows with a slot
    slots: torch.Tensor | None       # [R] their slots
    penalties: torch.Tensor | None   # [R, 3] float32: repetition, frequency, presence
    slot_list: list[_Slot]           # the slots, host side, in `rows` order


class LogitsProcessing:
    def __init__(self, device: torch.device, eos_token_ids: Sequence[int],
                 histories: Mapping[str, TokenHistory] | None) -> None:
        self.device = torch.device(device)
        self.eos_token_ids = tuple(eos_token_ids)
        self.histories = histories  # the engine's live requests by id (read only); None: no stateful rows
        self._slots: dict[str, _Slot] = {}
        self._reset_all(0)

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def prepare(self, params: Sequence[SamplingParams], output_indices: Sequence[int],
                request_ids: Sequence[str] | None, vocab: int) -> ProcessingBatch:
        """The batch's processing; brings the slots of rows that read their tokens up to their output index."""
        bias: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        banned: list[list[int]] = [[], []]
        words: list[list] = [[], [], [], []]
        stateful = [i for i, p in enumerate(params) if p.counts_tokens or p.reads_tail]
        slots = self._slots_for(stateful, output_indices, request_ids, vocab) if stateful else []
        slot_of = dict(zip(stateful, slots, strict=True))
        for i, (p, k) in enumerate(zip(params, output_indices, strict=True)):
            if p.logit_bias:
                bias.append((i, *_bias_of(p)))
            if k < p.min_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                banned[0] += [i] * len(ids)
                banned[1] += sorted(ids)
            for word in p.bad_words_token_ids:
                if len(word) == 1:
                    banned[0].append(i), banned[1].append(word[0])
                else:
                    words[0].append(i), words[1].append(slot_of[i].index)
                    words[2].append([ANY] * (TAIL + 1 - len(word)) + list(word[:-1])), words[3].append(word[-1])
        return ProcessingBatch(
            bias=self._bias(bias) if bias else None,
            banned=(self._ids(banned[0]), self._ids(banned[1])) if banned[0] else None,
            words=tuple(self._ids(w) for w in words) if words[0] else None,
            rows=self._ids(stateful) if stateful else None,
            slots=self._ids([s.index for s in slots]) if slots else None,
            penalties=self._floats([[params[i].repetition_penalty, params[i].frequency_penalty,
                                     params[i].presence_penalty] for i in stateful]) if stateful else None,
            slot_list=slots)

    def apply(self, batch: ProcessingBatch, logits: torch.Tensor) -> torch.Tensor:
        """logits [S, V] float32 (left untouched: logprobs read them) -> processed logits [S, V] float32."""
        out = logits.clone()
        if batch.bias is not None:
            out.index_put_(batch.bias[:2], batch.bias[2], accumulate=True)
        if batch.banned is not None:
            out.index_put_(batch.banned, torch.tensor(float("-inf"), device=out.device))
        if batch.words is not None:
            rows, slots, prefix, last = batch.words
            tails = self._tail.index_select(0, slots)  # [P, TAIL]
            match = ((tails == prefix) | (prefix == ANY)).all(dim=1)  # [P]
            ban = torch.zeros_like(match, dtype=out.dtype).masked_fill_(match, float("-inf"))  # [P]
            out.index_put_((rows, last), ban, accumulate=True)  # -inf where matched, + 0 elsewhere
        if batch.rows is not None and out.is_cuda:  # one pass instead of ~15 (engine.kernels.penalties)
            from engine.kernels.penalties import apply_penalties
            apply_penalties(out, batch.rows, batch.slots, self._counts, self._prompt, batch.penalties)
        elif batch.rows is not None:
            self._penalise(batch, out)
        return out

    def _penalise(self, batch: ProcessingBatch, out: torch.Tensor) -> None:
        """The penalties in torch ops, in place on out [S, V] (the kernel's reference)."""
        counts = self._counts.index_select(0, batch.slots)  # [R, V] int32
        seen = counts > 0  # [R, V]
        rep, freq, pres = batch.penalties.unbind(dim=1)  # [R] each
        x = out.index_select(0, batch.rows)  # [R, V]
        penalised = torch.where(x > 0, x / rep[:, None], x * rep[:, None])
        x = torch.where(seen | self._prompt.index_select(0, batch.slots), penalised, x)
        x = x - freq[:, None] * counts.float() - pres[:, None] * seen.float()
        out.index_copy_(0, batch.rows, x)

    def record(self, batch: ProcessingBatch, tokens: torch.Tensor) -> None:
        """Count the tokens just sampled (tokens [S] int64, on the device) into the batch's slots."""
        if batch.rows is None:
            return
        self._count(batch.slots, tokens.index_select(0, batch.rows))  # [R] sampled tokens
        for slot in batch.slot_list:
            slot.counted += 1

    # ---- slots
    def _slots_for(self, rows: list[int], output_indices: Sequence[int], request_ids: Sequence[str] | None,
                   vocab: int) -> list[_Slot]:
        if request_ids is None or self.histories is None:
            raise ValueError("penalties and bad words of several tokens need the requests' tokens: pass "
                             "request_ids to a Sampler built with the engine's requests")
        if vocab != self._vocab:
            self._reset_all(vocab)
        for rid in [r for r, s in self._slots.items() if self.histories.get(r) is not s.owner]:
            self._free.append(self._slots.pop(rid).index)
        slots, fresh, behind = [], [], []
        for i in rows:
            rid, k = request_ids[i], output_indices[i]
            owner = self.histories.get(rid)
            if owner is None:
                raise ValueError(f"request {rid!r} samples with penalties but the engine does not know it")
            slot = self._slots.get(rid)
            new = slot is None or slot.counted > k  # the latter never expected (outputs only grow): start over
            if slot is None:
                slot = self._slots[rid] = _Slot(self._take(), owner, 0)
            if new:
                fresh.append(slot)
            if new or slot.counted < k:
                behind.append((slot, k))
            slots.append(slot)
        if fresh:
            self._start(fresh)
        if behind:
            self._catch_up(behind)
        return slots

    def _start(self, slots: list[_Slot]) -> None:
        """Empty counts and tail; prompt presence from the host."""
        index = self._ids([s.index for s in slots])
        self._counts.index_fill_(0, index, 0)
        self._tail.index_fill_(0, index, NO_TOKEN)
        self._prompt.index_fill_(0, index, False)
        rows = [s.index for s in slots for _ in s.owner.prompt_token_ids]
        ids = [t for s in slots for t in s.owner.prompt_token_ids]
        self._prompt.index_put_((self._ids(rows), self._ids(ids)), torch.tensor(True, device=self.device))
        for s in slots:
            s.counted = 0

    def _catch_up(self, behind: list[tuple[_Slot, int]]) -> None:
        """Add outputs [counted, k) of each slot from its request's host-side tokens (they exist by then)."""
        rows, ids, tails = [], [], []
        for slot, k in behind:
            start = len(slot.owner.prompt_token_ids)
            known = len(slot.owner.all_token_ids) - start
            if k > known:
                raise RuntimeError(f"a slot needs {k} outputs but its request has {known} on the host")
            new = slot.owner.all_token_ids[start + slot.counted:start + k]
            rows += [slot.index] * len(new)
            ids += new
            tail = slot.owner.all_token_ids[max(start, start + k - TAIL):start + k]
            tails.append([NO_TOKEN] * (TAIL - len(tail)) + tail)
            slot.counted = k
        if ids:
            self._count(self._ids(rows), self._ids(ids), update_tail=False)
        self._tail.index_copy_(0, self._ids([s.index for s, _ in behind]), self._ids(tails))

    def _count(self, slots: torch.Tensor, tokens: torch.Tensor, update_tail: bool = True) -> None:
        """slots [N], tokens [N] int64: count each token once in its slot (and push it on the slot's tail)."""
        ones = torch.ones_like(tokens, dtype=torch.int32)
        self._counts.index_put_((slots, tokens), ones, accumulate=True)
        if update_tail:
            shifted = torch.cat([self._tail.index_select(0, slots)[:, 1:], tokens[:, None]], dim=1)  # [N, TAIL]
            self._tail.index_copy_(0, slots, shifted)

    def _take(self) -> int:
        if not self._free:
            old = self._counts.shape[0]
            new = max(8, 2 * old)
            self._counts = torch.cat([self._counts, self._counts.new_zeros(new - old, self._vocab)])
            self._prompt = torch.cat([self._prompt, self._prompt.new_zeros(new - old, self._vocab)])
            self._tail = torch.cat([self._tail, self._tail.new_full((new - old, TAIL), NO_TOKEN)])
            self._free = list(range(new - 1, old - 1, -1))
        return self._free.pop()

    def _reset_all(self, vocab: int) -> None:
        self._vocab = vocab
        self._slots.clear()
        self._free: list[int] = []
        self._counts = torch.zeros(0, vocab, dtype=torch.int32, device=self.device)  # [C, V]
        self._prompt = torch.zeros(0, vocab, dtype=torch.bool, device=self.device)   # [C, V]
        self._tail = torch.zeros(0, TAIL, dtype=torch.int64, device=self.device)     # [C, TAIL]

    # ---- host to device
    def _bias(self, rows: list[tuple[int, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        """rows [B], ids [B], biases [B] on the device from each row's cached host tensors."""
        index = torch.cat([torch.full_like(ids, i) for i, ids, _ in rows])
        ids = torch.cat([ids for _, ids, _ in rows])
        values = torch.cat([values for _, _, values in rows])
        return self._upload(index), self._upload(ids), self._upload(values)

    def _ids(self, values: list) -> torch.Tensor:
        return self._upload(torch.tensor(values, dtype=torch.int64))

    def _floats(self, values: list) -> torch.Tensor:
        return self._upload(torch.tensor(values, dtype=torch.float32))

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)


@functools.lru_cache(maxsize=1024)
def _bias_of(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's logit_bias as host tensors (ids [B] int64, biases [B] float32), built once per params."""
    return (torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64),
            torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32))
