"""StepExtras: what a step computes beyond one sampled token per sampling chunk, only for requests that ask.

- Group prefills (n choices of one prompt, engine.request): the first tokens of choices 1..n-1 are sampled from the
  SAME logits row as choice 0's, each with its own SamplingParams (its own derived seed) at the same output index,
  so each equals the first token a separate request with that seed would get. The rows are appended to the
  step's sampling call (one call, one host read) and split off again in LaunchedStep.
- Prompt logprobs: for a prefill chunk of a request with params.prompt_logprobs, the logits of the chunk's
  positions whose next token is a prompt token, as log_softmax in float32 (the chosen token's logprob, its rank and
  the top-k). They are read to the host at once (a synchronisation only such steps pay).
A step without either builds no StepExtras (None) and runs exactly as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from engine.core.request import PromptLogprob, Request, TokenLogprob
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledChunk, SchedulerOutput, StepOutput


@dataclass(frozen=True)
class PromptTargets:
    """One chunk's prompt-logprob work: the prompt tokens that follow its first len(targets) positions."""

    targets: list[int]
    top_k: int


@dataclass
class StepExtras:
    forks: dict[str, tuple[SamplingParams, ...]] = field(default_factory=dict)  # request id -> choices 1..n-1
    prompt: dict[str, PromptTargets] = field(default_factory=dict)             # request id -> its chunk's targets

    def __bool__(self) -> bool:
        return bool(self.forks or self.prompt)


def plan_extras(sched: SchedulerOutput, requests: Mapping[str, Request]) -> StepExtras | None:
    """Fork rows and prompt-logprob targets of this step's chunks (None, the usual case, when none asks)."""
    extras = StepExtras()
    for c in sched.chunks:
        req = requests[c.request_id]
        if req.fork_params and c.sample:
            extras.forks[c.request_id] = req.fork_params
        k, num_prompt = req.params.prompt_logprobs, len(req.prompt_token_ids)
        if k is not None and c.start_pos + 1 < num_prompt:
            targets = req.prompt_token_ids[c.start_pos + 1:min(c.start_pos + len(c.token_ids) + 1, num_prompt)]
            extras.prompt[c.request_id] = PromptTargets(targets, k)
    return extras or None


def record_extras(sampling: list[ScheduledChunk], prompt: dict[str, tuple[int, list[PromptLogprob]]],
                  fork_first: dict[str, list[tuple[int, TokenLogprob | None]]],
                  requests: Mapping[str, Request]) -> dict[str, Request]:
    """Store a step's prompt logprobs and fork first tokens on their requests (before the scheduler's update);
    returns the requests whose first token the step sampled and that carry either (see with_extras)."""
    for rid, (start, entries) in prompt.items():
        req = requests.get(rid)
        if req is not None:
            del req.prompt_logprobs[start:]  # a recompute (after preemption) starts over
            req.prompt_logprobs.extend(entries)
    for rid, first in fork_first.items():
        if rid in requests:
            requests[rid].fork_first = first
    firsts = {}
    for c in sampling:
        req = requests.get(c.request_id)
        if req is not None and c.output_index == len(req.prior_output_ids) and (
                req.fork_params is not None or req.params.prompt_logprobs is not None):
            firsts[c.request_id] = req
    return firsts


def with_extras(out: StepOutput, req: Request) -> StepOutput:
    """The first token's StepOutput, with the group's other first tokens and the prompt logprobs."""
    return replace(out, fork_first=list(req.fork_first) if req.fork_params is not None else None,
                   prompt_logprobs=list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None)


def fork_rows(chunks: list[ScheduledChunk], params: list[SamplingParams], forks: dict[str, tuple[SamplingParams, ...]]
              ) -> tuple[list[int], list[SamplingParams], list[int], list[str], dict[str, list[int]]]:
    """The sampling call's rows with every fork row appended: (logits row per sampling row, params, output
    indices, request ids, {request id: its fork rows' positions in the call})."""
    rows = list(range(len(chunks)))
    all_params, indices, ids = list(params), [c.output_index for c in chunks], [c.request_id for c in chunks]
    where: dict[str, list[int]] = {}
    for i, c in enumerate(chunks):
        for p in forks.get(c.request_id, ()):
            where.setdefault(c.request_id, []).append(len(rows))
            rows.append(i)
            all_params.append(p)
            indices.append(c.output_index)
            ids.append(c.request_id)
    return rows, all_params, indices, ids, where


def token_offsets(sched: SchedulerOutput) -> dict[str, int]:
    """Where each chunk's first token sits in the step's flat token order (engine.step_inputs: decode rows first,
    then prefill chunks, each group in schedule order)."""
    ordered = [c for c in sched.chunks if len(c.token_ids) == 1] + [c for c in sched.chunks if len(c.token_ids) > 1]
    offsets, at = {}, 0
    for c in ordered:
        offsets[c.request_id] = at
        at += len(c.token_ids)
    return offsets


def compute_prompt_logprobs(model, hidden: torch.Tensor, sched: SchedulerOutput,
                            wanted: dict[str, PromptTargets]) -> dict[str, tuple[int, list[PromptLogprob]]]:
    """hidden [T, h] (the step's last hidden states) -> {request id: (chunk start position, entries)}: entry i is
    the prompt token at position start + 1 + i given everything before it."""
    offsets = token_offsets(sched)
    out: dict[str, tuple[int, list[PromptLogprob]]] = {}
    for c in sched.chunks:
        want = wanted.get(c.request_id)
        if want is None or not want.targets:
            continue
        n = len(want.targets)
        rows = torch.arange(offsets[c.request_id], offsets[c.request_id] + n, device=hidden.device)  # [n]
        logprobs = model.compute_logits(hidden[rows]).float().log_softmax(dim=-1)  # [n, V]
        targets = torch.tensor(want.targets, dtype=torch.int64, device=hidden.device)  # [n]
        chosen = logprobs.gather(1, targets[:, None])  # [n, 1]
        rank = (logprobs > chosen).sum(dim=1) + 1  # [n]
        top_vals, top_ids = logprobs.topk(want.top_k, dim=-1)  # [n, k] each
        chosen_l, rank_l, vals_l, ids_l = chosen[:, 0].tolist(), rank.tolist(), top_vals.tolist(), top_ids.tolist()
        out[c.request_id] = (c.start_pos, [
            PromptLogprob(t, lp, r, dict(zip(ids, vals, strict=True)))
            for t, lp, r, ids, vals in zip(want.targets, chosen_l, rank_l, ids_l, vals_l, strict=True)])
    return out
