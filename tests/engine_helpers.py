"""Test helpers: transformers references, a logits recorder around the engine's real sampler, a step budget of fixed
figures."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from engine.core.sampling_params import SamplingParams


def hf_greedy(folder, prompts: list[list[int]], max_new_tokens: int,
              dtype=torch.float32) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens and per-step logits [steps, V] for each prompt (run one by one, no padding)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    results = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, len(prompt):].tolist()
        results.append((tokens, torch.stack([step[0].float() for step in out.logits])))
    return results


class LogitsRecorder:
    """Wraps an engine's sampler; records each request's logits rows by the identity of its SamplingParams."""

    def __init__(self, engine) -> None:
        self.sampler = engine.runner.sampler
        self.rows: dict[int, list[torch.Tensor]] = {}
        engine.runner.sampler = self

    def launch(self, logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int],
               request_ids=None):
        for row, p in zip(logits, params, strict=True):
            self.rows.setdefault(id(p), []).append(row.clone())
        return self.sampler.launch(logits, params, output_indices, request_ids)

    def logits_of(self, params: SamplingParams) -> torch.Tensor:
        return torch.stack(self.rows[id(params)])  # [steps, V]


def assert_greedy_matches(llm, prompts: list[list[int]], refs: list[tuple[list[int], torch.Tensor]], new_tokens: int,
                          tolerance: float) -> None:
    """`llm.generate`'s greedy tokens equal transformers' (`refs`: hf_greedy's) and its logits are within
    `tolerance`, for `new_tokens` tokens each; the engine's sampler is put back afterwards."""
    recorder = LogitsRecorder(llm.engine)
    params = [SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True) for _ in prompts]
    try:
        outs = llm.generate(prompts, params)
        for out, p, (tokens, logits) in zip(outs, params, refs, strict=True):
            assert out.token_ids == tokens[:new_tokens]
            diff = (recorder.logits_of(p).cpu() - logits[:new_tokens]).abs().max().item()
            assert diff < tolerance, f"max abs logits difference {diff}"
    finally:
        llm.engine.runner.sampler = recorder.sampler


def random_prompts(lengths, vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def prefill_then_hand_over(prefill, decode, prompts: list[list[int]], params: list[SamplingParams], tag: str = "r",
                           reuse_prefix: bool = False) -> dict[str, list[int]]:
    """Disaggregation on two engines in one process: `prefill` runs each prompt prefill-only (request ids tag0, tag1,
    ...), `decode` reserves its blocks, takes a copy of the pinned KV (what kvtransfer does) and decodes it to the end,
    checking its integrity after every step. Each request's tokens, the first (sampled by `prefill`) included. With
    `reuse_prefix`, the reservation names the prompt's block hashes (decode_pool.reservations): the blocks the
    decode engine's prefix cache holds lead its table and only the others are copied."""
    from engine.core.block_manager import prefix_block_hashes

    for i, prompt in enumerate(prompts):
        prefill.add_request(f"{tag}{i}", prompt, params[i], prefill_only=True)
    firsts = {}
    while prefill.has_unfinished():
        firsts.update({o.request_id: o for o in prefill.step()})
    got: dict[str, list[int]] = {}
    bs = decode.config.block_size
    for i, prompt in enumerate(prompts):
        rid, first = f"{tag}{i}", firsts[f"{tag}{i}"]
        hashes = prefix_block_hashes(prompt[:-1], bs) if reuse_prefix else ()
        blocks = decode.reserve_blocks(rid, len(prompt), prefix_hashes=hashes)
        k = decode.reserved_hits(rid)
        assert blocks is not None and k < len(blocks) == -(-len(prompt) // bs)  # the prompt's KV
        decode.kv_cache[blocks[k:]] = prefill.kv_cache[first.pinned_block_ids[k:]]  # the blocks decode lacks
        prefill.release(rid)
        assert decode.add_prefilled_request(rid, prompt, first.new_token_ids[0], params[i]) is None
        got[rid] = list(first.new_token_ids)
    while decode.has_unfinished():
        for out in decode.step():
            got[out.request_id] += out.new_token_ids
        decode.check_integrity()
    return got


def run_alone(engine, request_id: str, prompt: list[int], params) -> tuple[list[int], object]:
    """Run one request alone on `engine` to its end, checking block ownership after every step: its tokens and its
    first StepOutput."""
    engine.add_request(request_id, prompt, params)
    tokens, first = [], None
    while engine.has_unfinished():
        for out in engine.step():
            first = first or out
            tokens += out.new_token_ids
        engine.check_integrity()
    return tokens, first


class FixedStepBudget:
    """A StepBudget (engine.core.step_budget) whose figures the test sets: `tokens` a decoding step may carry under
    `target_s`; it learns nothing from the steps."""

    def __init__(self, tokens: int, target_s: float) -> None:
        self.tokens, self.target_s = tokens, target_s

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        pass
