"""Request-shape and per-sequence figures: what each generated sequence was when it ended, in pdserve's names and
in vLLM's (coordinator.observability.metrics creates them on its app's registry; lifecycle.Generation reports each
sequence's end here through `SequenceEnd`).

Owns, observed once per sequence (one per choice: a request with n = 3 observes three) when it ends, unless it was
refused before it ran (outcome `rejected`):
- `pdserve_request_finish_total{reason}`: stop, length, tool_calls (as the client saw them), abort (the client left),
  timeout (the request's deadline), error (a backend failure or a bug);
- `pdserve_request_generation_tokens`: tokens generated (vLLM's alias `vllm:request_generation_tokens`);
- `vllm:request_success_total{finished_reason}`: vLLM's finish reasons: stop (tool_calls included: vLLM's engine
  sees a stop), length, abort (timeout included), error;
- `vllm:request_params_max_tokens`: the max_tokens the sequence ran with (the default, when the client gave none);
- `vllm:request_time_per_output_token_seconds`: (last token - first token) / (tokens - 1) as the coordinator
  received them, 0 for a one-token sequence, as vLLM observes it.
Once per prompt (pdserve prefills a prompt once for its n choices; vLLM's engine counts each child request):
- `pdserve_request_prompt_tokens` (alias `vllm:request_prompt_tokens`);
- `vllm:request_params_n` and `vllm:request_max_num_generation_tokens` (the most tokens any of its choices
  generated), when its last choice ends (`Parent`);
- from the request's phases (coordinator.observability.phases; single-choice requests only, the choices path is not
  traced): `vllm:request_queue_time_seconds` = admission + prefill_queue (waiting for room, then for the prefill
  engine), `vllm:request_prefill_time_seconds` = prefill_compute (first engine step to first token),
  `vllm:request_decode_time_seconds` = kv_transfer + decode_join + first_decode_step + decode (first token to last),
  `vllm:request_inference_time_seconds` = prefill + decode; migration and overhead are in none of them.
vLLM's families are labelled `model_name` (vLLM adds `engine`, its engine-core index: a request here may run on two
workers, so it has none). Buckets are vLLM's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

FINISH_REASONS = ("stop", "length", "tool_calls", "abort", "timeout", "error")
VLLM_FINISH = {"stop": "stop", "tool_calls": "stop", "length": "length", "abort": "abort", "timeout": "abort",
               "error": "error"}
_OUTCOME_REASON = {"aborted": "abort", "timeout": "timeout", "failed": "error"}
QUEUE_PHASES = ("admission", "prefill_queue")
PREFILL_PHASES = ("kv_restore", "prefill_compute")
DECODE_PHASES = ("kv_transfer", "decode_join", "first_decode_step", "decode")
N_BUCKETS = (1, 2, 5, 10, 20)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


@dataclass(frozen=True)
class SequenceEnd:
    """One sequence at its end, as lifecycle.Generation knows it."""

    outcome: str                 # finished, aborted, failed, timeout, rejected
    finish_reason: str | None    # on a finished sequence, the client's: stop, length, tool_calls
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int
    first_token_at: float | None  # time.monotonic() of its first and last token's arrival
    last_token_at: float | None
    counts_prompt: bool          # the first choice of its prompt: prompt figures are counted once
    phases: dict[str, float] | None = None  # its final phases, when traced


class Parent:
    """The choices of one prompt (vLLM's parent request): `n` the client asked for, `children` sequences run (n, or
    best_of). The most tokens any generated is known when the last ends."""

    def __init__(self, n: int, children: int | None = None) -> None:
        self.n = n
        self._left = children or n
        self.max_generation_tokens = 0

    def child_ended(self, generation_tokens: int) -> bool:
        """Count one sequence out; True when it was the last."""
        self.max_generation_tokens = max(self.max_generation_tokens, generation_tokens)
        self._left -= 1
        return self._left == 0


class RequestFigures:
    """The families above on `registry`; `observe(end, parent)` records one sequence's end."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        tokens = token_buckets(max(max_model_len, 1))
        label = ["model_name"]
        self.finish = Counter("pdserve_request_finish", "Sequences ended, by finish reason (one per choice)",
                              ["reason"], registry=registry)
        for reason in FINISH_REASONS:
            self.finish.labels(reason)
        self.prompt_tokens = Histogram("pdserve_request_prompt_tokens", "Prompt tokens of each request's prompt (once "
                                       "for its n choices)", buckets=tokens, registry=registry)
        self.generation_tokens = Histogram("pdserve_request_generation_tokens", "Tokens generated by each sequence "
                                           "(one per choice)", buckets=tokens, registry=registry)
        success = Counter("vllm:request_success", "Count of finished requests by vLLM's finish reason (vLLM's name; "
                          "one per sequence)", label + ["finished_reason"], registry=registry)
        self.success = {reason: success.labels(model_name, reason) for reason in sorted(set(VLLM_FINISH.values()))}
        # what another HTTP process adds to its scrape (coordinator.observability.metrics)
        self.local: list[Counter | Histogram] = [self.finish, self.prompt_tokens, self.generation_tokens, success]

        def histogram(name: str, help: str, buckets: Iterable[float]) -> Histogram:
            family = Histogram(name, help, label, buckets=buckets, registry=registry)
            self.local.append(family)
            return family.labels(model_name)
        self.max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens each sequence ran "
                                    "with (vLLM's name)", tokens)
        self.n = histogram("vllm:request_params_n", "Histogram of the n request parameter, once per prompt (vLLM's "
                           "name)", N_BUCKETS)
        self.max_generation = histogram("vllm:request_max_num_generation_tokens", "Histogram of the most tokens any "
                                        "choice of a prompt generated (vLLM's name)", tokens)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds", "Each sequence's mean time per output "
                              "token after the first, as the coordinator received them (vLLM's name)", TPOT_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Seconds waiting: pdserve's admission + "
                               "prefill_queue phases (vLLM's name; single-choice requests)", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Seconds of prefill: pdserve's prefill_compute "
                                 "phase (vLLM's name; single-choice requests)", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "Seconds from the first token to the last: "
                                "pdserve's kv_transfer + decode_join + first_decode_step + decode phases (vLLM's name; "
                                "single-choice requests)", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds", "Seconds of prefill + decode (vLLM's name; "
                                   "single-choice requests)", REQUEST_LATENCY_BUCKETS)

    def observe(self, end: SequenceEnd, parent: Parent | None = None) -> None:
        if end.outcome == "rejected":  # refused before it ran: no finish, no shape
            return
        reason = (end.finish_reason or "stop") if end.outcome == "finished" else _OUTCOME_REASON.get(end.outcome,
                                                                                                     "error")
        self.finish.labels(reason if reason in FINISH_REASONS else "stop").inc()
        self.success[VLLM_FINISH.get(reason, "stop")].inc()
        self.generation_tokens.observe(end.generation_tokens)
        self.max_tokens.observe(end.max_tokens)
        if end.first_token_at is not None and end.last_token_at is not None:
            gaps = end.generation_tokens - 1
            self.tpot.observe((end.last_token_at - end.first_token_at) / gaps if gaps > 0 else 0.0)
        if end.counts_prompt:
            self.prompt_tokens.observe(end.prompt_tokens)
        if end.phases is not None:
            queue, prefill, decode = (sum(end.phases.get(p, 0.0) for p in phases)
                                      for phases in (QUEUE_PHASES, PREFILL_PHASES, DECODE_PHASES))
            self.queue.observe(queue)
            self.prefill.observe(prefill)
            self.decode.observe(decode)
            self.inference.observe(prefill + decode)
        parent = parent or Parent(1)
        if parent.child_ended(end.generation_tokens):
            self.n.observe(parent.n)
            self.max_generation.observe(parent.max_generation_tokens)
