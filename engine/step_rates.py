"""The engine's step rates measured before it reports ready, so that a step budget has figures from the first
request on (issue 43: an adaptive layout's placement read "unknown" on both sides of a burst right after start, and
sent every prompt remote).

With a decode step target (EngineConfig.decode_step_target_s, the adaptive layout's workers), the engine's
StepBudget learns a step's base time and each prompt token's cost from the steps it runs, and EngineLoad reports
them (`decode_step_s`, `prefill_token_s`), which the coordinator's placement model reads. `measure_step_rates` runs
one probe request (a prompt of the step budget's ceiling, then a few decode steps, greedy) through the engine's own
step(), from fresh averages (steps of a CUDA warm-up before it, with their compiles, say nothing of the rates),
then undoes what it left (LLMEngine.start_counting: the prefix cache and host tier emptied, the counters from zero,
as after a warm-up). Runs on any device: it is a request like any other.
With a prefill lane (EngineConfig.sm_split_decode_sms) a second probe gives the lane its figures too (its seconds
per prompt token, EngineLoad.lane_token_s, which the placement model and the planner read): short requests
decoding (one, or as many as its split table needs before it takes a prompt), and beside them another prompt (of
other tokens: the first one's are cached), which the lane takes.
"""

from __future__ import annotations

from typing import Any

from engine.core.sampling_params import SamplingParams
from engine.core.step_budget import StepBudget
from engine.lane_splits import fewest_lane_rows
from engine.runner.prefill_lane import RATE_MIN_TOKENS

PROBE_ID = "pdserve-step-rate-probe"
LANE_PROBE_ID = "pdserve-lane-rate-probe"  # the prompt the lane takes
DECODING_PROBE_ID = "pdserve-lane-rate-decoding"  # + "-k": the requests decoding beside it (aborted once it is done)
DECODING_PROMPT = 8  # tokens of the decoding request's prompt
PROBE_DECODES = 4  # decode steps after the prompt's
PROBE_MAX_PROMPT = 2048  # a prompt of the step budget's ceiling, at most this long (an 8B prefill of it: ~0.1 s)
PROBE_MAX_STEPS = 10_000  # a bound on the probe's steps: a start never hangs on it
ROW_DECODES = 64  # tokens a decoding request of the lane's probe may decode (more than a job's steps beside it)
PROBE_LANE_STEPS = 1_000  # a bound on each wait of the lane's probe (a 2k-token 8B job: ~20 decode steps)


def measure_step_rates(engine: Any) -> None:
    """Teach `engine`'s (an LLMEngine, which calls this as it starts: not imported here, no cycle) step budget its
    rates (see the module); nothing without a step budget."""
    budget = engine.step_budget
    if budget is None:
        return
    engine.step_budget = StepBudget(budget.target_s, budget.floor_tokens, budget.ceiling_tokens)
    config = engine.config
    room = engine.num_kv_blocks * config.block_size - PROBE_DECODES - 1  # the probe fits the cache alone
    length = min(budget.ceiling_tokens, config.max_prefill_chunk or budget.ceiling_tokens, PROBE_MAX_PROMPT,
                 config.max_model_len - PROBE_DECODES - 1, room)
    if length < 1:
        return
    vocab = engine.model_config.vocab_size
    prompt = [(17 * i + 3) % vocab for i in range(length)]
    engine.add_request(PROBE_ID, prompt, SamplingParams(temperature=0, max_tokens=PROBE_DECODES + 1, ignore_eos=True))
    if not _steps_until(engine, lambda: not engine.has_unfinished()):  # never expected (it fits alone): give up on
        engine.abort(PROBE_ID)                                          # the figures rather than on the start
        engine.step_budget = StepBudget(budget.target_s, budget.floor_tokens, budget.ceiling_tokens)
    elif engine.lane is not None and length - DECODING_PROMPT >= RATE_MIN_TOKENS:
        _probe_lane(engine, [(19 * i + 5) % vocab for i in range(length - DECODING_PROMPT)])
    engine.start_counting()
    engine.check_integrity()


def _probe_lane(engine: Any, prompt: list[int]) -> None:
    """Requests decoding (as many as the lane needs beside it: its split table may chunk beside few rows), then
    `prompt` (cut to what the cache holds beside them) beside them: the step that plans it hands it to the lane."""
    config, vocab, block_size = engine.config, engine.model_config.vocab_size, engine.config.block_size
    rows = fewest_lane_rows(engine.lane.table)
    decodes = min(ROW_DECODES, config.max_model_len - DECODING_PROMPT)
    row_blocks = -(-(DECODING_PROMPT + decodes) // block_size)  # a row's blocks at the most
    prompt = prompt[:max((engine.num_kv_blocks - rows * row_blocks) * block_size, 0)]
    if rows >= config.max_num_seqs or len(prompt) < RATE_MIN_TOKENS:
        return  # the lane's figures come with its first job instead
    ids = [f"{DECODING_PROBE_ID}-{k}" for k in range(rows)]
    for k, request_id in enumerate(ids):
        decoding = [(23 * i + 7 + k) % vocab for i in range(DECODING_PROMPT)]
        engine.add_request(request_id, decoding, SamplingParams(temperature=0, max_tokens=decodes, ignore_eos=True))
    requests = engine.scheduler.requests
    if _steps_until(engine, lambda: all(rid in requests and requests[rid].num_pending_tokens <= 1 for rid in ids),
                    PROBE_LANE_STEPS):
        engine.add_request(LANE_PROBE_ID, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        _steps_until(engine, lambda: LANE_PROBE_ID not in engine.scheduler.requests, PROBE_LANE_STEPS)
    for request_id in (LANE_PROBE_ID, *ids):
        engine.abort(request_id)
    # (a job of an aborted prompt is applied by the next step, even with nothing else to run)
    _steps_until(engine, lambda: not engine.has_unfinished() and not engine.lane.busy, PROBE_LANE_STEPS)


def _steps_until(engine: Any, done: Any, limit: int = PROBE_MAX_STEPS) -> bool:
    """Step the engine until done() (at most `limit` steps); whether it got there."""
    for _ in range(limit):
        if done():
            return True
        engine.step()
    return done()
