"""GrammarManager: structured outputs in one engine, through llguidance (see benchmarks/sampling_costs.py
grammar-masks for why).

Owns, for one engine and its tokenizer: the library's view of the vocabulary (built once, from tokenizer.json, EOS
ids the model's), compiled grammars (one template matcher per StructuredSpec key, LRU-bounded, copied per request),
one matcher per constrained request, the host bitmask buffer, and applying the masks to a step's logits on the
device before sampling. Rows without a grammar cost nothing: a step with none of them skips all of this.

Life of a matcher: `make` builds it (and consumes the tokens the request already has: prior outputs of a migrated
request, and on a decode worker the first token the prefill worker sampled under the same grammar); `advance`
consumes each accepted token once, keyed by its output index (so the overlapped path and the plain path may both
call it); `after_update` ends a request whose grammar is complete with finish_reason "stop" (and one whose matcher
failed with "error": its mask and the request's bans left no allowed token), except a group prefill, which stays
pinned whatever its first tokens, and drops matchers of requests that ended (or whose id a later request took: a
matcher is bound to its request's incarnation, and a chunk of another never reads or advances it). `constrain` is the
model runner's logits hook: for an overlapped decode step it first waits for the previous step's tokens (the device
computes this step's forward meanwhile, so the host's mask work hides behind it), advances, then fills this step's
masks with the library's thread pool and applies them in place.

Buffer reuse: the host bitmask is refilled only after the previous step's tokens were read back, which the device
produces after it copied the previous masks, so a non-blocking copy is never overwritten while in flight.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import llguidance  # not llguidance.torch: its import compiles a helper with torch.compile, importing dynamo (4 s)
import torch

from engine.sampling.structured import StructuredSpec, grammar_text

MAX_CACHED_GRAMMARS = 256


@dataclass
class _Row:
    matcher: llguidance.LLMatcher
    consumed: int  # outputs consumed so far: the output index of the next token it takes
    incarnation: int = 0  # its request's (Request.incarnation): chunks of an earlier request of the id are not its


class GrammarManager:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device,
                 max_rows: int) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._executor = llguidance.LLExecutor()
        self._templates: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._rows: dict[str, _Row] = {}
        cuda = self.device.type == "cuda"
        self._host = torch.zeros((max_rows, (vocab_size + 31) // 32), dtype=torch.int32, pin_memory=cuda)
        self._shifts = torch.arange(32, dtype=torch.int32, device=self.device)
        self.fill_time_s = 0.0  # host time spent filling masks, and the steps that filled some (for figures)
        self.num_fills = 0

    # ---- requests
    def make(self, request_id: str, spec: StructuredSpec, tokens: Sequence[int], last_may_fail: bool = False) -> _Row:
        """A matcher for the request, having consumed `tokens` (outputs it already has); `attach` it once the
        request is queued. ValueError if the spec does not compile or the tokens break it; with `last_may_fail`,
        a last token that breaks it (sampled where the mask and the request's bans left no allowed token) leaves
        the matcher failed instead: finish_reason then says "error", as after a step."""
        matcher = self._template(spec).deep_copy()
        tokens = list(tokens)
        strict = tokens[:-1] if last_may_fail else tokens
        if strict and not matcher.consume_tokens(strict):
            raise ValueError(f"request {request_id!r}: its prior outputs do not match its structured output spec "
                             f"({matcher.get_error()})")
        if last_may_fail and tokens:
            matcher.consume_tokens(tokens[-1:])
        return _Row(matcher, len(tokens))

    def attach(self, request_id: str, row: _Row, incarnation: int) -> None:
        """`row` (from make) constrains the request `request_id` of this Request.incarnation from now on."""
        row.incarnation = incarnation
        self._rows[request_id] = row

    def has(self, request_id: str) -> bool:
        return request_id in self._rows

    def drop(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def advance(self, request_id: str, output_index: int, token: int) -> None:
        row = self._rows.get(request_id)
        if row is None or output_index < row.consumed or row.matcher.is_stopped() or row.matcher.is_error():
            return
        if output_index != row.consumed:
            raise RuntimeError(f"request {request_id!r}: grammar at output {row.consumed}, got output {output_index}")
        row.matcher.consume_token(token)
        row.consumed += 1

    def finish_reason(self, request_id: str) -> str | None:
        """"stop" once the grammar is complete (nothing more may follow), "error" if the matcher failed."""
        row = self._rows.get(request_id)
        if row is None:
            return None
        if row.matcher.is_error():
            return "error"
        return "stop" if row.matcher.is_stopped() else None

    def after_update(self, outputs: list[Any], requests: dict[str, Any],
                     finish: Callable[[str, str], bool]) -> list[Any]:
        """Advance over a step's outputs (scheduler StepOutputs); end requests whose grammar is complete."""
        for rid in [r for r, row in self._rows.items()  # ended some other way (abort, release, expiry), maybe
                    if r not in requests or requests[r].incarnation != row.incarnation]:  # its id taken again since
            del self._rows[rid]
        result = []
        for out in outputs:
            req = requests.get(out.request_id)
            if out.request_id in self._rows and out.finish_reason is None and req is not None:
                first = req.num_output_tokens - len(out.new_token_ids)
                for i, token in enumerate(out.new_token_ids):
                    self.advance(out.request_id, first + i, token)
                reason = self.finish_reason(out.request_id)
                # a group prefill stays pinned whatever its first tokens: each choice's end is decided where it
                # decodes (LLMEngine.add_prefilled_request)
                if reason is not None and req.fork_params is None and finish(out.request_id, reason):
                    out = replace(out, finish_reason=reason, pinned_block_ids=None)
            if out.finish_reason is not None:
                self.drop(out.request_id)
            result.append(out)
        return result

    # ---- masks
    @torch.inference_mode()
    def constrain(self, chunks: Sequence[Any], logits: torch.Tensor, after: Any | None) -> None:
        """Model-runner hook: mask logits [S, V] (one row per sampling chunk) in place for constrained rows."""
        if not self._rows:
            return
        if after is not None and after.sampled is not None:
            pending = [(c.request_id, c.output_index) for c in after.sampling if self._row(c) is not None]
            if pending:
                tokens = after.result()  # the previous step's tokens, waited for while this step's forward runs
                for rid, index in pending:
                    self.advance(rid, index, tokens[rid][0])
        rows = [(i, r) for i, r in enumerate(map(self._row, chunks))
                if r is not None and not (r.matcher.is_stopped() or r.matcher.is_error())]
        if not rows:
            return
        start = time.perf_counter()
        mask = self._host[:len(rows)]  # contiguous int32 rows on the host, as the library writes them
        self._executor.unsafe_compute_mask_ptr([(r.matcher, j) for j, (_, r) in enumerate(rows)], mask.data_ptr(),
                                               mask.shape[1] * mask.element_size(), len(rows))
        self.fill_time_s += time.perf_counter() - start
        self.num_fills += 1
        apply_bitmask(logits, mask, [i for i, _ in rows], self._shifts)

    def _row(self, chunk: Any) -> _Row | None:
        """The matcher of the request a planned chunk (engine.core.step_plan.ScheduledChunk) was planned for."""
        row = self._rows.get(chunk.request_id)
        return row if row is not None and row.incarnation == chunk.incarnation else None

    def _template(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        template = self._templates.get(spec.key)
        if template is not None:
            self._templates.move_to_end(spec.key)
            return template
        template = llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0)
        if template.is_error():
            raise ValueError(f"structured output spec does not compile: {template.get_error()}")
        self._templates[spec.key] = template
        if len(self._templates) > MAX_CACHED_GRAMMARS:
            self._templates.popitem(last=False)
        return template


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int], shifts: torch.Tensor) -> None:
    """logits [S, V] on the device; mask [R, ceil(V/32)] int32 on the host (bit v%32 of word v//32 set: allowed),
    one per entry of `rows` (row indices into logits). Disallowed tokens become -inf, in place."""
    n, vocab = len(rows), logits.shape[1]
    bits = mask.to(logits.device, non_blocking=True)  # [R, W]
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(n, -1)[:, :vocab].bool()  # [R, V]
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))
