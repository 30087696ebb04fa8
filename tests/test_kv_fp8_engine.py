"""An engine with `kv_cache_dtype: fp8` (engine.kv_quant) against the same engine with a bfloat16 cache: greedy
agreement and the KL divergence of the logits, twice the KV tokens for the same memory, the Triton path against the
torch path, prefix-cache hits, checkpoint scales and the setting's validation."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.engine_config import EngineConfig
from engine.kv_quant import FP8_DTYPE, KVScales
from tests.engine_helpers import LogitsRecorder, random_prompts
from tests.test_model_exactness import vocab_size_of

pytestmark = pytest.mark.gpu  # runs its GPU path on a CUDA device when there is one (tests/conftest.py)

NEW_TOKENS = 24
LENGTHS = (7, 19, 33, 50, 64, 90)
# Measured on this random checkpoint (printed with -s): teacher-forced top-1 agreement ~0.9 and mean KL ~0.02 nats.
# e4m3 keeps 3 mantissa bits: each cached K/V element is rounded with a relative error up to 2^-4 (bfloat16: 2^-8),
# so attention outputs move by about 3% RMS; this checkpoint's random weights give sharp next-token distributions
# (logits of tens), in which such a move shifts the distribution by a few hundredths of a nat. For scale: a float16
# model against the bfloat16 one (rounding everywhere, 3 more mantissa bits) gives ~0.0025 here. The bounds leave
# a 2-3x margin over the measurement; a broken cache (a lost scale, a wrong byte) gives a KL of whole nats and
# agreement near 1/vocab.
MAX_MEAN_KL = 0.06
# on a GPU (Triton kernels, CUDA graphs) when there is one: the path the fp8 cache exists for
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# engines that share a GPU with a module's others (fixtures keep them alive): a fixed KV budget each there
ON = dict(device=DEVICE, kv_cache_memory_bytes=256 << 20) if DEVICE == "cuda" else dict(device=DEVICE)
MIN_AGREEMENT = 0.8


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> list[tuple[list[int], torch.Tensor]]:
    recorder = LogitsRecorder(llm.engine)
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) for _ in prompts]
    outs = llm.generate(prompts, params)
    return [(out.token_ids, recorder.logits_of(p).float().cpu()) for out, p in zip(outs, params, strict=True)]


def teacher_forced(ref_llm: LLM, llm: LLM, prompts: list[list[int]]) -> tuple[float, float, float]:
    """(free-running greedy agreement: share of positions whose tokens agree; teacher-forced top-1 agreement and
    mean KL(ref || test) of the next-token distributions, every position conditioned on the same context: the
    reference's prompt plus its first i generated tokens, for every i)."""
    ref = _greedy(ref_llm, prompts)
    free = _greedy(llm, prompts)
    free_agree = sum(a == b for (r, _), (t, _) in zip(ref, free, strict=True) for a, b in zip(r, t, strict=True))
    contexts = [p + tokens[:i] for p, (tokens, _) in zip(prompts, ref, strict=True) for i in range(NEW_TOKENS)]
    ref_rows = torch.stack([row for _, logits in ref for row in logits])  # [P * NEW_TOKENS, V]
    rows = torch.cat([logits for _, logits in _greedy(llm, contexts, 1)])
    p, q = ref_rows.log_softmax(-1), rows.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    top1 = (ref_rows.argmax(-1) == rows.argmax(-1)).float().mean().item()
    return free_agree / ref_rows.shape[0], top1, kl


def test_fp8_cache_agrees_with_bfloat16(checkpoints):
    folder = checkpoints.get("LlamaForCausalLM")
    prompts = random_prompts(LENGTHS, vocab_size_of(folder), seed=5)
    ref_llm = LLM(str(folder), dtype="bfloat16", **ON)
    llm = LLM(str(folder), dtype="bfloat16", **ON, kv_cache_dtype="fp8")
    assert llm.engine.kv_cache.dtype == torch.float8_e4m3fn and llm.engine.kv_spec.dtype == FP8_DTYPE
    free, top1, kl = teacher_forced(ref_llm, llm, prompts)
    print(f"\nfp8 vs bfloat16 KV cache: free-running greedy agreement {free:.3f}; teacher-forced top-1 agreement "
          f"{top1:.3f}, mean logits KL {kl:.2e} nats")
    assert top1 >= MIN_AGREEMENT and kl <= MAX_MEAN_KL, (top1, kl)
    # the control: the bfloat16 engine against itself (its prefill and decode kernels round differently, so not 0)
    _, self_top1, self_kl = teacher_forced(ref_llm, ref_llm, prompts)
    print(f"bfloat16 against itself: teacher-forced top-1 agreement {self_top1:.3f}, mean KL {self_kl:.2e} nats")
    assert self_top1 >= top1 and self_kl < kl


def test_fp8_doubles_the_tokens_a_budget_holds(checkpoints):
    folder = checkpoints.get("LlamaForCausalLM")
    budget = 4 << 20
    bf16 = LLM(str(folder), dtype="bfloat16", device=DEVICE, kv_cache_memory_bytes=budget).engine
    fp8 = LLM(str(folder), dtype="bfloat16", device=DEVICE, kv_cache_memory_bytes=budget, kv_cache_dtype="fp8").engine
    assert fp8.kv_spec.block_bytes * 2 == bf16.kv_spec.block_bytes
    assert fp8.num_kv_blocks == 2 * bf16.num_kv_blocks
    assert fp8.kv_cache.numel() * fp8.kv_cache.element_size() <= budget


def test_kernel_path_reads_and_writes_the_cache_as_the_torch_path(checkpoints):
    """The Triton path (interpreted on a CPU) and the torch path (with the C decode kernel where it builds) on one
    fp8 cache: the same greedy tokens, logits within float32 rounding (both quantize the same values the same way;
    float32 activations keep the comparison free of bfloat16 rounding). Chunked prefill puts decode rows and a
    chunk after a cached prefix in one step."""
    folder = checkpoints.get("LlamaForCausalLM", num_hidden_layers=1)
    prompts = random_prompts((5, 17, 30), vocab_size_of(folder), seed=6)
    kw = dict(kv_cache_dtype="fp8", max_num_batched_tokens=8, block_size=8, enable_prefix_caching=False)
    torch_path = _greedy(LLM(str(folder), **kw), prompts)
    llm = LLM(str(folder), kernels="triton", **ON, **kw)
    assert llm.engine.model.kernels_enabled
    for (ref_tokens, ref_logits), (tokens, logits) in zip(torch_path, _greedy(llm, prompts), strict=True):
        assert tokens == ref_tokens
        assert (logits - ref_logits).abs().max() < 1e-3


def test_prefix_cache_hits_read_the_fp8_blocks(checkpoints):
    folder = checkpoints.get("LlamaForCausalLM")
    prompts = random_prompts((40, 56), vocab_size_of(folder), seed=7)
    llm = LLM(str(folder), dtype="bfloat16", **ON, kv_cache_dtype="fp8", block_size=8)
    first = _greedy(llm, prompts)
    before = llm.engine.scheduler.num_prefix_hit_tokens
    again = _greedy(llm, prompts)
    assert llm.engine.scheduler.num_prefix_hit_tokens - before == (39 // 8 + 55 // 8) * 8
    assert [t for t, _ in again] == [t for t, _ in first]
    assert llm.engine.check_integrity()["in_use"] == 0


def test_checkpoint_kv_scales_are_loaded(checkpoints, tmp_path):
    """A checkpoint's self_attn.k_scale / v_scale reach every layer (and the spec's fingerprint); the weights load
    past them; with calibrated-looking scales the output still agrees with bfloat16."""
    src = checkpoints.get("LlamaForCausalLM")
    folder = tmp_path / "scaled"
    folder.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    scales = {0: (0.25, 0.5), 1: (0.125, 2.0)}
    for layer, (k, v) in scales.items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, folder / "model.safetensors")
    llm = LLM(str(folder), dtype="bfloat16", **ON, kv_cache_dtype="fp8_e4m3")
    got = [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in llm.engine.model.model.layers]
    assert got == [scales[0], scales[1]]
    assert llm.engine.kv_spec.kv_scales == KVScales((0.25, 0.125), (0.5, 2.0)).digest() != KVScales.ones(2).digest()
    prompts = random_prompts(LENGTHS[:3], vocab_size_of(folder), seed=8)
    _, top1, kl = teacher_forced(LLM(str(src), dtype="bfloat16", **ON), llm, prompts)
    assert top1 >= MIN_AGREEMENT and kl <= MAX_MEAN_KL, (top1, kl)
    # a bfloat16 cache ignores the scales: the same checkpoint gives the unscaled engine's output exactly
    plain = LLM(str(folder), dtype="bfloat16", **ON)
    unscaled = LLM(str(src), dtype="bfloat16", **ON)
    assert [t for t, _ in _greedy(plain, prompts)] == [t for t, _ in _greedy(unscaled, prompts)]


@pytest.mark.parametrize("value", ["int8", "fp8_e5m2", "FP8", None])
def test_bad_kv_cache_dtype_is_refused_by_name(value):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype=value)
