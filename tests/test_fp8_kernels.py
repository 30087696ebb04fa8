"""The FP8 linears' kernel path (engine.kernels.fp8_quant, engine.kernels.fp8_gemm, Fp8Linear.use_kernels): the
quantizing kernels give torch's e4m3 bytes and scales bit for bit; the GEMV and the tensor-core kernel compute the
upcast product up to float32 summation order; Fp8Linear's three matmuls (by M) agree with its torch path; an FP8
model's kernel path gives its torch path's greedy tokens. On a GPU all of it runs compiled (FP8 tensor cores and
torch._scaled_mm for the large M); on the CPU under Triton's interpreter, where torch._scaled_mm's branch is
replaced by the tensor-core kernel's (it needs CUDA)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.make_random_checkpoint import quantize_folder, quantize_weight
from engine import LLM, SamplingParams
from engine.kernels import fp8_gemm
from engine.kernels.fp8_gemm import fp8_gemv, fp8_mm
from engine.kernels.fp8_quant import SPLIT_CHUNK, SPLIT_ROWS, quantize_rows, rms_norm_quant, silu_mul_quant
from engine.kernels.rms_norm import rms_norm
from engine.kernels.silu_mul import silu_and_mul
from engine.model import fp8_linear
from engine.model.fp8_linear import FP8, Fp8Linear, Fp8Rows
from engine.model.fp8_linear import quantize_rows as torch_quantize_rows
from engine.model.quant_config import Fp8Scheme
from tests.engine_helpers import LogitsRecorder, random_prompts
from tests.test_model_exactness import vocab_size_of

pytestmark = pytest.mark.gpu  # runs its GPU path on a CUDA device when there is one (tests/conftest.py)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter runs every program in Python: small shapes there, the model's on a GPU
K, N = (4096, 6144) if DEVICE == "cuda" else (96, 72)


def same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == FP8 and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def rand(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("static", [False, True])
def test_quantize_rows_is_torchs_bit_for_bit(static):
    x = rand(7, K, seed=1, scale=3.0)
    x[2] = 0  # a row of zeros gets the smallest scale, not a division by zero
    x[3, 5] = 1e4  # saturates at 448 under a static scale
    input_scale = torch.tensor([0.02], device=DEVICE) if static else None
    q, s = quantize_rows(x, input_scale)
    q_ref, s_ref = torch_quantize_rows(x, input_scale)
    assert same_fp8(q, q_ref) and torch.equal(s, s_ref)
    assert torch.isfinite(q.float()).all()


def test_rms_norm_quant_is_rms_norm_then_quantize():
    x, weight, residual = rand(5, K, seed=2), rand(K, seed=3), rand(5, K, seed=4)
    r_plain, r_fused = residual.clone(), residual.clone()
    normed, _ = rms_norm(x, weight, 1e-5, r_plain)
    q, s = rms_norm_quant(x, weight, 1e-5, r_fused)
    q_ref, s_ref = torch_quantize_rows(normed, None)
    assert same_fp8(q, q_ref) and torch.equal(s, s_ref)
    assert torch.equal(r_plain, r_fused)  # the residual stream is updated in place the same way
    q2, s2 = rms_norm_quant(x, weight, 1e-5, None, torch.tensor([0.05], device=DEVICE))
    q2_ref, _ = torch_quantize_rows(rms_norm(x, weight, 1e-5), torch.tensor([0.05], device=DEVICE))
    assert same_fp8(q2, q2_ref) and (s2 == 0.05).all()


@pytest.mark.parametrize("rows", [1, 3, SPLIT_ROWS + 1])  # rows spread over programs (two launches), or one each
def test_silu_mul_quant_is_silu_mul_then_quantize(rows: int):
    inter = max(K, SPLIT_CHUNK) + 40  # a row longer than one chunk of either path, not a multiple of it
    gate_up = rand(rows, 2 * inter, seed=5, scale=2.0)
    gate_up[0, 1050] = gate_up[0, inter + 1050] = 30.0  # the row's largest SwiGLU value, in its second chunk
    q, s = silu_mul_quant(gate_up)
    q_ref, s_ref = torch_quantize_rows(silu_and_mul(gate_up), None)
    assert same_fp8(q, q_ref) and torch.equal(s, s_ref)
    static = torch.tensor([0.05], device=DEVICE)
    q2, s2 = silu_mul_quant(gate_up, static)
    q2_ref, _ = torch_quantize_rows(silu_and_mul(gate_up), static)
    assert same_fp8(q2, q2_ref) and (s2 == 0.05).all()


def fp8_operands(m: int, seed: int) -> tuple[torch.Tensor, ...]:
    xq, xs = torch_quantize_rows(rand(m, K, seed=seed), None)
    wq, ws = quantize_weight(rand(N, K, seed=seed + 1, dtype=torch.float32, scale=0.05), "channel")
    return xq, xs, wq, ws.reshape(1, -1).contiguous()


@pytest.mark.parametrize("m", [1, 2, 5, 16, 33, 64, 130])
def test_fp8_gemms_compute_the_upcast_product(m):
    xq, xs, wq, ws = fp8_operands(m, seed=10 + m)
    bias = rand(N, seed=9)
    exact = (xq.double() @ wq.double().t()) * xs.double() * ws.double()  # [M, N]
    kernels = [fp8_mm] + ([fp8_gemv] if m <= 16 else [])
    for kernel in kernels:
        out = kernel(xq, xs, wq, ws, None, torch.float32)
        # float32 sums: ~1e-6 here. Hopper's FP8 tensor cores accumulate inside the MMA with about 14 bits (DeepSeek-
        # V3's report): over all of K = 4096 that left 3.5e-3 on an H200, so fp8_mm adds each 256-wide tile's MMA
        # sum in float32 (promotion), which this bound asks for; a wrong index or scale is O(1)
        tolerance = 2e-3 if kernel is fp8_mm and DEVICE == "cuda" else 1e-5
        assert ((out.double() - exact).abs().max() / exact.abs().max()).item() < tolerance, kernel.__name__
        with_bias = kernel(xq, xs, wq, ws, bias, torch.bfloat16)
        ref = (exact + bias.double()).to(torch.bfloat16)
        assert ((with_bias.double() - ref.double()).abs().max() / ref.double().abs().max()).item() < 2 ** -7


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("split_k", [2, 3, 4])
def test_fp8_mm_with_k_split_is_the_unsplit_product_and_leaves_its_semaphores_zero(m, split_k):
    """K cut into 2-4 slices (4 leaves the interpreter's last one empty) meeting on semaphores the caller keeps: the
    same product as one slice, twice in a row (the last split to arrive set every semaphore back to 0)."""
    xq, xs, wq, ws = fp8_operands(m, seed=40 + m)
    bias = rand(N, seed=41, dtype=torch.float32)
    block = (16, 16, 32, 4, 1) if DEVICE == "cpu" else (64, min(64, max(16, m)), 256, 4, 4)
    sems = torch.zeros(1024, dtype=torch.int32, device=DEVICE)
    whole = fp8_mm(xq, xs, wq, ws, bias, torch.float32, config=(*block, 1))
    for _ in range(2):
        split = fp8_mm(xq, xs, wq, ws, bias, torch.float32, config=(*block, split_k), semaphores=sems)
        assert ((split - whole).abs().max() / whole.abs().max()).item() < 1e-5
        assert not sems.any()


def test_fp8_gemv_weight_only_multiplies_16_bit_rows_by_the_upcast_weight():
    """x in bfloat16 with no scales: x @ (w_q * s_w)^T up to float32 summation order, no activation rounding."""
    _, _, wq, ws = fp8_operands(2, seed=50)
    bias = rand(N, seed=51, dtype=torch.float32)
    for m in (1, 2):
        x = rand(m, K, seed=52 + m)
        exact = (x.double() @ wq.double().t()) * ws.double() + bias.double()
        out = fp8_gemv(x, None, wq, ws, bias, torch.float32)
        assert ((out.double() - exact).abs().max() / exact.abs().max()).item() < 1e-5
    with pytest.raises(ValueError, match="x_scales"):
        fp8_gemv(wq[:1], None, wq, ws)  # e4m3 x needs its scales
    with pytest.raises(ValueError, match="x_scales"):
        fp8_mm(x, None, wq, ws)  # the tensor-core kernel takes e4m3 x only


def test_gated_fp8_gemv_is_the_gemv_then_silu_and_mul():
    """A fused [gate; up] e4m3 weight's gated GEMV (weight-only, what an MLP runs at M = 1; and with e4m3 x): silu(gate)
    * up as silu_and_mul makes it of the plain GEMV's output, bit for bit; Fp8Linear.gated is the weight-only one."""
    _, _, wq, ws = fp8_operands(2, seed=60)  # [N, K]: gate the first N / 2 rows, up the rest
    for m in (1, 2):
        x = rand(m, K, seed=61 + m)
        out = fp8_gemv(x, None, wq, ws, gated=True)
        assert out.shape == (m, N // 2)
        assert torch.equal(out, silu_and_mul(fp8_gemv(x, None, wq, ws)))
        xq, xs = torch_quantize_rows(x, None)
        assert torch.equal(fp8_gemv(xq, xs, wq, ws, gated=True), silu_and_mul(fp8_gemv(xq, xs, wq, ws)))
    layer = Fp8Linear(K, N, False, Fp8Scheme("compressed-tensors", "channel", "dynamic"), torch.bfloat16,
                      device=DEVICE)
    layer.weight.data, layer.weight_scale.data = (
        t.to(DEVICE) for t in quantize_weight(rand(N, K, seed=65, dtype=torch.float32, scale=0.05), "channel"))
    layer.finish()
    layer.use_kernels = True
    x = rand(1, K, seed=64)
    assert torch.equal(layer.gated(x), silu_and_mul(layer(x)))
    with pytest.raises(ValueError, match="even"):
        fp8_gemv(x, None, wq[:-1], ws[:, :-1], gated=True)


@pytest.mark.parametrize("m", [1, 2, 3, 64, 200])
def test_fp8_linear_kernel_path_agrees_with_its_torch_path(m, monkeypatch):
    """By M: the GEMV (1, 2; weight-only at 1: the 16-bit rows as they are, which the torch path quantizes, so
    the bound allows the activations' rounding), the tensor-core kernel (3, 64), torch._scaled_mm on CUDA (200);
    static scales too."""
    w = rand(N, K, seed=20, dtype=torch.float32, scale=0.05)
    x = rand(m, K, seed=21)
    for strategy, activations in (("channel", "dynamic"), ("tensor", "static")):
        layer = Fp8Linear(K, N, True, Fp8Scheme("compressed-tensors", strategy, activations), torch.bfloat16,
                          device=DEVICE)
        layer.weight.data, scale = (t.to(DEVICE) for t in quantize_weight(w, strategy))
        layer.weight_scale.data = scale
        layer.bias.data = rand(N, seed=22)
        if activations == "static":
            layer.input_scale.data = torch.tensor([0.02], device=DEVICE)
        layer.finish()
        expected = layer(x).float()
        layer.use_kernels = True
        got = layer(x).float()
        quantized = layer(Fp8Rows(*torch_quantize_rows(x, layer.input_scale))).float()
        assert ((quantized - expected).abs().max() / expected.abs().max()).item() < 2 ** -6, (strategy, m)
        if m <= fp8_linear.GEMV_ROWS:  # weight-only: x unrounded (K = 4,096 on an H200: 0.023 from the torch path)
            expected = (x.float() @ (layer.weight.float() * layer.scale_row.t()).t() + layer.bias.float())
        assert ((got - expected).abs().max() / expected.abs().max()).item() < 2 ** -6, (strategy, m)


def test_an_fp8_models_kernel_path_gives_its_torch_paths_tokens(checkpoints, tmp_path):
    """Two layers in float32 (no bfloat16 rounding between the paths): the same greedy tokens and logits within a
    few hundredths of the largest (the activations' e4m3 rounding may differ where sums in another order cross a
    rounding boundary: one e4m3 step is 6%). The norms quantize for q/k/v and gate/up, SiLU-mul for down, o_proj
    quantizes itself. Measured: under 0.03 interpreted on the CPU; 0.045-0.047 on an H200 (FP8 tensor cores, their
    sums promoted every 256 products), with the same tokens. A wrong scale or index moves logits by whole units."""
    folder = quantize_folder(checkpoints.get("LlamaForCausalLM", num_hidden_layers=2), tmp_path / "fp8", "channel")
    prompts = random_prompts((6, 19), vocab_size_of(folder), seed=3)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True) for _ in prompts]
    outputs = []
    for kernels in ("torch", "triton"):
        llm = LLM(str(folder), device=DEVICE if kernels == "triton" else "cpu", kernels=kernels, dtype="float32",
                  enable_prefix_caching=False)
        if kernels == "triton":
            layer = llm.engine.model.model.layers[0]
            assert layer.input_layernorm.quantize_for is layer.self_attn.qkv_proj
            assert layer.post_attention_layernorm.quantize_for is layer.mlp.gate_up_proj
        recorder = LogitsRecorder(llm.engine)
        outs = llm.generate(prompts, params)
        outputs.append(([o.token_ids for o in outs], [recorder.logits_of(p).float().cpu() for p in params]))
    (ref_tokens, ref_logits), (tokens, logits) = outputs
    diffs = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(logits, ref_logits, strict=True)]
    assert tokens == ref_tokens, (tokens, ref_tokens, diffs)
    assert max(diffs) < (0.08 if DEVICE == "cuda" else 0.03), diffs


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
def test_fused_fp8_qkv_rope_store_is_the_gemv_then_rope_and_store(kv_dtype):
    """At M = 1 an FP8 projection runs qkv + RoPE + KV store as one kernel: the same q/k/v and cache bytes as the
    FP8 GEMV followed by rope_and_store (up to float32 summation order: the products are the same)."""
    from engine.kernels.qkv_rope import qkv_rope_store
    from engine.kernels.rope import rope_and_store
    from engine.model.rope import RotaryEmbedding
    h, kvh, d = (32, 8, 128) if DEVICE == "cuda" else (4, 2, 16)
    hidden = K
    rope = RotaryEmbedding(d, 256, 10000.0, None)
    rope.build(DEVICE)
    xq, xs = torch_quantize_rows(rand(1, hidden, seed=30), None)
    wq, ws = quantize_weight(rand((h + 2 * kvh) * d, hidden, seed=31, dtype=torch.float32, scale=0.05), "channel")
    ws = ws.reshape(1, -1).contiguous()
    positions = torch.tensor([77], device=DEVICE)
    slots = torch.tensor([5], device=DEVICE)
    caches = [torch.zeros(3, 2, 4, kvh, d, dtype=kv_dtype, device=DEVICE) for _ in range(2)]
    fused = qkv_rope_store(xq, wq, None, h, kvh, positions, rope.cos, rope.sin, caches[0], slots,
                           x_scales=xs, w_scales=ws, out_dtype=torch.bfloat16)
    ref = fp8_gemv(xq, xs, wq, ws)
    rq, rk, rv = ref.view(1, h + 2 * kvh, d).split([h, kvh, kvh], dim=1)
    rope_and_store(rq, rk, rv, positions, rope.cos, rope.sin, caches[1], slots)
    assert ((fused.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 2 ** -7
    stored = (caches[0].float() - caches[1].float()).abs().max() / caches[1].float().abs().max()
    assert caches[1].float().abs().max() > 0 and stored.item() < 2 ** -3  # an e4m3 cache: one rounding step
    # weight-only (what the model runs at M = 1): bfloat16 x, no x_scales, the GEMV's product
    x = rand(1, hidden, seed=32)
    fused = qkv_rope_store(x, wq, None, h, kvh, positions, rope.cos, rope.sin, caches[0], slots, w_scales=ws,
                           out_dtype=torch.bfloat16)
    ref = fp8_gemv(x, None, wq, ws)
    rq, rk, rv = ref.view(1, h + 2 * kvh, d).split([h, kvh, kvh], dim=1)
    rope_and_store(rq, rk, rv, positions, rope.cos, rope.sin, caches[1], slots)
    assert ((fused.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 2 ** -7
    stored = (caches[0].float() - caches[1].float()).abs().max() / caches[1].float().abs().max()
    assert stored.item() < 2 ** -3


def test_thresholds_order_the_paths():
    assert 1 <= fp8_linear.GEMV_ROWS < fp8_linear.MM_ROWS


def test_launch_rules_by_how_many_tiles_an_sm_gets(monkeypatch):
    """fp8_mm's launch on a 132-SM GPU (the 70B and 8B projections): K split where the tiles leave SMs idle, wide
    tiles for a wide weight at 32 rows and more, the table's own otherwise."""
    monkeypatch.setattr(fp8_gemm, "interpreting", lambda: False)
    stages = fp8_gemm.FP8_MM_CONFIGS[0][5]
    assert fp8_gemm.mm_config(4, 10240, 8192, 132) == (64, 16, 256, 4, stages, 1)  # 160 tiles
    assert fp8_gemm.mm_config(4, 57344, 8192, 132) == (64, 16, 256, 4, stages, 1)  # 896 tiles
    assert fp8_gemm.mm_config(4, 4096, 4096, 132) == (64, 16, 256, 4, stages, 2)  # 64 tiles: K split
    assert fp8_gemm.mm_config(16, 4096, 14336, 132) == (64, 16, 256, 4, stages, 2)
    wide_n, wide_k, wide_warps, wide_stages = fp8_gemm.WIDE_CONFIG  # 8B gate_up at 64 rows
    assert fp8_gemm.mm_config(64, 28672, 4096, 132) == (wide_n, 64, wide_k, wide_warps, wide_stages, 1)
    assert fp8_gemm.mm_config(16, 28672, 4096, 132)[:2] == (64, 16)  # narrow tiles below WIDE_MIN_BLOCK_M


@pytest.mark.parametrize("m", [5, 64])
@pytest.mark.parametrize("split_k", [1, 2])
def test_fp8_mm_reads_the_same_weight_tiles_by_tma_as_by_pointer_loads(m, split_k):
    """w_tma=True (the weight's tiles by a tensor descriptor, zero-filled past N and K) gives the pointer loads' bits:
    the same tiles, multiplied and summed in the same order. N is not a multiple of the tile on the CPU (72 rows)."""
    xq, xs, wq, ws = fp8_operands(m, seed=60 + m)
    block = (16, 16, 32, 4, 1) if DEVICE == "cpu" else (64, 64, 256, 4, 4)
    sems = torch.zeros(1024, dtype=torch.int32, device=DEVICE)
    loads = fp8_mm(xq, xs, wq, ws, None, torch.float32, config=(*block, split_k), semaphores=sems)
    tma = fp8_mm(xq, xs, wq, ws, None, torch.float32, config=(*block, split_k), semaphores=sems, w_tma=True)
    assert torch.equal(loads, tma)
    assert not sems.any()
    unaligned = torch.zeros(N, K + 8, dtype=FP8, device=DEVICE)[:, :K]  # rows K + 8 bytes apart
    unaligned.copy_(wq)
    with pytest.raises(ValueError, match="w_tma needs weight rows 16-byte aligned"):
        fp8_mm(xq, xs, unaligned, ws, None, torch.float32, config=(*block, split_k), w_tma=True)
