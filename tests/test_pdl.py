"""Programmatic dependent launch (engine.kernels.pdl): a kernel that may start before the one it depends on ends
must still see every byte that one wrote. On a Hopper GPU, chains of the decode step's kernels (each reading the
previous one's output), captured in a CUDA graph with PDL, give the same bits as ordinary launches, and so does a
whole engine's greedy decode. A race would show as a difference. Elsewhere PDL is off: the CPU and the
interpreter have no such launch."""

from __future__ import annotations

import pytest
import torch

from benchmarks.make_random_checkpoint import quantize_folder
from engine import LLM, SamplingParams
from engine.kernels import pdl
from engine.kernels.decode_attention import decode_attention
from engine.kernels.fp8_gemm import fp8_gemv, fp8_mm
from engine.kernels.fp8_quant import rms_norm_quant, silu_mul_quant
from engine.kernels.pdl import MAX_ROWS, pdl_args, pdl_launch
from engine.kernels.rms_norm import rms_norm
from engine.kernels.silu_mul import silu_and_mul
from engine.kernels.skinny_gemm import skinny_linear
from tests.engine_helpers import LogitsRecorder, random_prompts
from tests.test_model_exactness import vocab_size_of

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs a CUDA GPU of compute "
                                                     "capability 9.0+ (Hopper); nothing to launch that way here")
HIDDEN, INTER, LAYERS = 4096, 14336, 6
FP8 = torch.float8_e4m3fn


def test_pdl_is_off_off_the_gpu_and_when_turned_off(monkeypatch):
    assert pdl_launch(torch.device("cpu")) is False
    assert pdl_args(torch.device("cpu"), 1) == {"PDL": False, "PDL_LATE": False, "launch_pdl": False}
    assert pdl_launch(torch.device("cuda", 0), MAX_ROWS + 1) is False  # a large step: decided before any CUDA call
    monkeypatch.setenv("PDSERVE_PDL", "0")
    assert pdl_launch(torch.device("cuda", 0)) is False


def test_fp8_kernels_past_max_rows_launch_late_up_to_late_max_rows(monkeypatch):
    """Early triggers up to MAX_ROWS; past it only a kernel that may (the FP8 linears': `late`) launches with PDL,
    its trigger after each program's main loop, up to LATE_MAX_ROWS; none beyond. The device check (asked once per
    device) is stood in for, so this runs anywhere."""
    monkeypatch.setattr(pdl, "interpreting", lambda: False)
    monkeypatch.setattr(pdl, "_hopper_or_later", lambda index: True)
    monkeypatch.setenv("PDSERVE_PDL", "1")
    dev = torch.device("cuda", 0)
    off = {"PDL": False, "PDL_LATE": False, "launch_pdl": False}
    monkeypatch.setattr(pdl, "LATE_MAX_ROWS", 64)
    for late in (False, True):
        assert pdl_args(dev, MAX_ROWS, late) == {"PDL": True, "PDL_LATE": False, "launch_pdl": True}
    assert pdl_args(dev, MAX_ROWS + 1) == off
    assert pdl_args(dev, MAX_ROWS + 1, late=True) == {"PDL": True, "PDL_LATE": True, "launch_pdl": True}
    assert pdl_args(dev, 64, late=True)["PDL_LATE"] and pdl_args(dev, 65, late=True) == off
    monkeypatch.setattr(pdl, "LATE_MAX_ROWS", MAX_ROWS)  # late launches turned off
    assert pdl_args(dev, MAX_ROWS + 1, late=True) == off
    monkeypatch.setenv("PDSERVE_PDL", "0")
    assert pdl_args(dev, 1) == off


def weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    w = {"norm": 1 + rand(HIDDEN, scale=0.1), "up": rand(2 * INTER, HIDDEN, scale=0.02),
         "down": rand(HIDDEN, INTER, scale=0.01)}
    for name in ("up", "down"):
        amax = w[name].float().abs().amax(dim=1, keepdim=True)
        scale = (amax / 448.0).clamp(min=1e-12)
        w[name + "8"] = (w[name].float() / scale).to(FP8)
        w[name + "8s"] = scale.reshape(1, -1).contiguous()
    return w


def mlp_chain(x: torch.Tensor, w: dict[str, torch.Tensor], fp8: bool) -> torch.Tensor:
    """LAYERS MLP blocks as a decode step runs them (rows of x: the batch), every kernel reading the one before."""
    residual = torch.zeros_like(x)
    for _ in range(LAYERS):
        if not fp8:
            h, residual = rms_norm(x, w["norm"], 1e-5, residual)
            x = skinny_linear(silu_and_mul(skinny_linear(h, w["up"])), w["down"])
        elif x.shape[0] == 1:  # weight-only GEMVs, as fp8_linear runs one row
            h, residual = rms_norm(x, w["norm"], 1e-5, residual)
            up = fp8_gemv(h, None, w["up8"], w["up8s"])
            x = fp8_gemv(silu_and_mul(up), None, w["down8"], w["down8s"])
        else:  # quantizing kernels and the FP8 tensor-core kernel, as fp8_linear runs a batch
            q, s = rms_norm_quant(x, w["norm"], 1e-5, residual)
            up = fp8_mm(q, s, w["up8"], w["up8s"])
            q, s = silu_mul_quant(up)
            x = fp8_mm(q, s, w["down8"], w["down8s"])
    return x + residual


def graph_of(fn, x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(x)  # compiles and warms outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x)
    return graph, out


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("fp8,rows", [(False, 1), (False, 2), (True, 1), (True, 8), (True, 16), (True, 32),
                                      (True, 64)])
def test_a_graph_of_pdl_launches_gives_the_ordinary_launches_bits(monkeypatch, fp8, rows):
    """Rows past MAX_ROWS: late triggers (LATE_MAX_ROWS raised for the test)."""
    monkeypatch.setattr(pdl, "LATE_MAX_ROWS", 64)
    w = weights(seed=rows)
    x = (torch.randn(rows, HIDDEN, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7))
         ).to(torch.bfloat16)
    monkeypatch.setenv("PDSERVE_PDL", "0")
    plain = mlp_chain(x, w, fp8).clone()
    monkeypatch.setenv("PDSERVE_PDL", "1")
    assert pdl_launch(x.device, rows, late=fp8)  # past MAX_ROWS only the FP8 linears' kernels (late triggers)
    eager = mlp_chain(x, w, fp8)
    graph, out = graph_of(lambda t: mlp_chain(t, w, fp8), x)
    for _ in range(20):  # replays back to back: any early read would have many chances to show
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, plain)
    assert torch.equal(out, plain)


@needs_hopper
@pytest.mark.gpu
def test_decode_attention_reads_the_kv_its_predecessor_just_wrote(monkeypatch):
    """The cache row of the step's own token is written by the kernel right before attention: under PDL the
    attention kernel starts early and must still read it."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    batch, heads, kv_heads, dim, bs, blocks = 8, 32, 8, 128, 16, 64
    kv = torch.randn(batch * blocks, 2, bs, kv_heads, dim, device="cuda", generator=gen).to(torch.bfloat16)
    tables = torch.arange(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), blocks * bs, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, dim, device="cuda", generator=gen).to(torch.bfloat16)
    last = torch.randn(batch, kv_heads, dim, device="cuda", generator=gen).to(torch.bfloat16)

    def step(q_in: torch.Tensor) -> torch.Tensor:
        # the last token's K row, written by a Triton kernel (rms_norm's output lands in the cache's memory)
        rows = kv.view(batch, blocks, 2, bs, kv_heads, dim)[:, -1, 0, -1].reshape(batch, kv_heads * dim)
        rms_norm(last.reshape(batch, kv_heads * dim), torch.ones(kv_heads * dim, device="cuda",
                                                                 dtype=torch.bfloat16), 1e-5, out=rows)
        return decode_attention(q_in, kv, tables, lens, dim ** -0.5)

    monkeypatch.setenv("PDSERVE_PDL", "0")
    plain = step(q).clone()
    monkeypatch.setenv("PDSERVE_PDL", "1")
    graph, out = graph_of(step, q)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain)


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype,fp8", [("auto", False), ("fp8", False), ("auto", True), ("fp8", True)])
def test_an_engine_decodes_the_same_bits_with_and_without_pdl(monkeypatch, checkpoints, tmp_path, kv_cache_dtype,
                                                              fp8):
    """FP8 weights with MAX_ROWS lowered to 1: the FP8 linears' kernels of every step of 2-64 rows (the 3 rows'
    decode steps, the prompts' prefill) launch with late triggers, beside the other kernels' ordinary launches."""
    folder = checkpoints.get("LlamaForCausalLM")
    if fp8:
        monkeypatch.setattr(pdl, "MAX_ROWS", 1)
        folder = quantize_folder(checkpoints.get("LlamaForCausalLM", dtype="bfloat16"), tmp_path / "fp8", "channel")
    prompts = random_prompts((7, 30, 61), vocab_size_of(folder), seed=5)
    results = []
    for flag in ("0", "1"):
        monkeypatch.setenv("PDSERVE_PDL", flag)
        llm = LLM(str(folder), device="cuda", kernels="triton", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                  enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20)
        recorder = LogitsRecorder(llm.engine)
        params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in prompts]
        outs = llm.generate(prompts, params)
        assert llm.engine.runner.graphs.replays > 0, "decode steps were meant to replay CUDA graphs"
        results.append(([o.token_ids for o in outs], [recorder.logits_of(p).cpu() for p in params]))
        llm.engine.close()
    (tokens0, logits0), (tokens1, logits1) = results
    assert tokens0 == tokens1
    for a, b in zip(logits0, logits1, strict=True):
        assert torch.equal(a, b)
