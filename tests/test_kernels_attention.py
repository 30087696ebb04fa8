"""The Triton paged-attention kernels (decode, prefill) against a float64 torch reference.

On the CPU they run in Triton's interpreter (small shapes); on a GPU the same tests run compiled, plus real-size
checks that also print achieved bandwidth / matmul-rate fractions (printed, not asserted: run with -s)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import decode_attention as decode_mod
from engine.kernels import prefill_attention as prefill_mod
from engine.kernels.decode_attention import decode_attention
from engine.kernels.prefill_attention import prefill_attention

pytestmark = pytest.mark.gpu  # runs its GPU path on a CUDA device when there is one (tests/conftest.py)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
LAYERS = 3  # the kernels get kv[:, 1], a strided view of a multi-layer cache


def make_cache(gen: torch.Generator, num_blocks: int, bs: int, kvh: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """kv[NB, L, 2, bs, KVH, D] of random data (as the engine allocates it); tests pass the layer view kv[:, 1].
    Drawn on the device (real-size caches are gigabytes), seeded from `gen`."""
    dev_gen = torch.Generator(device=DEV).manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    return torch.randn(num_blocks, LAYERS, 2, bs, kvh, d, generator=dev_gen, device=DEV).to(dtype)


def make_tables(gen: torch.Generator, contexts: list[int], bs: int, max_blocks: int, num_blocks: int) -> torch.Tensor:
    """[N, max_blocks] int32: each sequence gets distinct random (non-monotonic) block ids; the padding past its
    blocks holds random ids too (the kernels must not care)."""
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(contexts), max_blocks), generator=gen, dtype=torch.int32)
    used = 0
    for i, ctx in enumerate(contexts):
        nb = -(-ctx // bs)
        table[i, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    assert used <= num_blocks
    return table.to(DEV)


def reference(q: torch.Tensor, kv_layer: torch.Tensor, table: torch.Tensor, ctx: int, scale: float,
              window: int | None) -> torch.Tensor:
    """float64 attention of one sequence's last q.shape[0] positions. q [n, H, D] -> [n, H, D]."""
    n, h, d = q.shape
    kvh = kv_layer.shape[3]
    blocks = kv_layer[table.long()].double()  # [max_blocks, 2, bs, KVH, D]
    k = blocks[:, 0].reshape(-1, kvh, d)[:ctx].repeat_interleave(h // kvh, dim=1)  # [ctx, H, D]
    v = blocks[:, 1].reshape(-1, kvh, d)[:ctx].repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
    key = torch.arange(ctx, device=q.device)[None, :]
    allowed = key <= pos
    if window is not None:
        allowed &= key > pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), "NaN in output (unwritten element?)"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]}"


# --- decode --------------------------------------------------------------------------------------------------------

DECODE_CASES = [
    # (group, kv_heads, head_dim, block_size, dtype, num_splits, window, contexts)
    pytest.param(1, 2, 32, 16, torch.float32, 1, None, [1, 16, 37, 0, 64], id="mha-bs16-fp32-1split"),
    pytest.param(4, 2, 32, 8, torch.bfloat16, 3, None, [0, 1, 8, 45, 20], id="gqa4-bs8-bf16-3splits"),
    pytest.param(8, 1, 64, 16, torch.float16, 7, None, [33, 0, 1, 17], id="gqa8-bs16-fp16-splits>blocks"),
    pytest.param(4, 2, 32, 8, torch.float32, 2, 13, [1, 13, 50, 0, 30], id="gqa4-bs8-fp32-window"),
    pytest.param(4, 2, 32, 32, torch.bfloat16, 4, 20, [70, 5, 0], id="gqa4-bs32-bf16-window-4splits"),
    pytest.param(2, 2, 32, 16, torch.float32, None, None, [40, 0, 3], id="default-splits"),
]


@pytest.mark.parametrize("group,kvh,d,bs,dtype,splits,window,contexts", DECODE_CASES)
def test_decode_matches_reference(group, kvh, d, bs, dtype, splits, window, contexts):
    gen = torch.Generator().manual_seed(100 * group + 10 * bs + (splits or 0) + (window or 0))
    heads, max_blocks = group * kvh, max(-(-c // bs) for c in contexts) + 2
    num_blocks = sum(-(-c // bs) for c in contexts) + 3
    kv = make_cache(gen, num_blocks, bs, kvh, d, dtype)
    tables = make_tables(gen, contexts, bs, max_blocks, num_blocks)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEV)
    # q as the engine slices it out of a fused QKV projection: a view with a larger token stride
    q = torch.randn(len(contexts), heads + 2, d, generator=gen).to(dtype).to(DEV)[:, 1:heads + 1]
    scale = d ** -0.5
    out = torch.full_like(q, float("nan"))

    got = decode_attention(q, kv[:, 1], tables, lens, scale, sliding_window=window, num_splits=splits, out=out)

    assert got is out
    for b, ctx in enumerate(contexts):
        if ctx == 0:
            assert (out[b] == 0).all(), "a context-0 padding row must be zeros"
        else:
            assert_close(out[b:b + 1], reference(q[b:b + 1], kv[:, 1], tables[b], ctx, scale, window), dtype)


def test_decode_tile_wider_than_split(monkeypatch):
    """BLOCK_N = 64 (the GPU tile) over block size 8 and 5 splits: tiles overhang split ends and table rows."""
    monkeypatch.setattr(decode_mod, "launch_config", lambda *shape: (64, 4, 1))
    gen = torch.Generator().manual_seed(7)
    contexts, bs, kvh, d = [100, 1, 0, 64], 8, 2, 16
    kv = make_cache(gen, 40, bs, kvh, d, torch.float32)
    tables = make_tables(gen, contexts, bs, 13, 40)
    q = torch.randn(4, 8, d, generator=gen).to(DEV)
    out = decode_attention(q, kv[:, 1], tables, torch.tensor(contexts, dtype=torch.int32, device=DEV), 0.3,
                           num_splits=5, out=torch.full_like(q, float("nan")))
    assert (out[2] == 0).all()
    for b in (0, 1, 3):
        assert_close(out[b:b + 1], reference(q[b:b + 1], kv[:, 1], tables[b], contexts[b], 0.3, None), torch.float32)


@pytest.mark.parametrize("cache_dtype,window", [(torch.bfloat16, None), (torch.float8_e4m3fn, None),
                                                 (torch.bfloat16, 45)])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_early_first_tile_gives_the_same_bits(cache_dtype, window, splits):
    """EARLY_KV (on a GPU under PDL: each slice's first tile loaded before the wait when all its tokens are older
    than the step's own) computes what the loop computes: bit for bit, with contexts whose first tile is early, ends
    at the newest token, is partial, or is missing. Forced on here, where PDL's wait is a no-op."""
    gen = torch.Generator().manual_seed(23 + splits)
    contexts, bs, kvh, d, group = [1, 32, 33, 64, 65, 100, 0, 47], 8, 2, 32, 4
    max_blocks = max(-(-c // bs) for c in contexts) + 1
    num_blocks = sum(-(-c // bs) for c in contexts) + 2
    kv = make_cache(gen, num_blocks, bs, kvh, d, torch.bfloat16).to(cache_dtype)
    tables = make_tables(gen, contexts, bs, max_blocks, num_blocks)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEV)
    q = torch.randn(len(contexts), group * kvh, d, generator=gen).to(torch.bfloat16).to(DEV)
    scales = {"k_scale": 0.7, "v_scale": 1.3} if cache_dtype == torch.float8_e4m3fn else {}
    runs = [decode_attention(q, kv[:, 1], tables, lens, d ** -0.5, sliding_window=window, num_splits=splits,
                             early_kv=early, **scales) for early in (False, True)]
    assert torch.equal(runs[0], runs[1])
    if cache_dtype == torch.bfloat16:
        for b, ctx in enumerate(contexts):
            if ctx:
                assert_close(runs[1][b:b + 1], reference(q[b:b + 1], kv[:, 1], tables[b], ctx, d ** -0.5, window),
                             torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_lazy_softmax_follows_a_rising_max(dtype, splits):
    """The lazy softmax (the running max lags by up to 2^8; acc rescaled only when a row's max passes it by more)
    against the exact one and float64, on keys whose scores climb along the context: by less than 8 (log2) a tile
    in one row, by more in another, so tiles both reuse a stale max and rescale. A lazy step that never rescales
    after the first tile overflows p; one that rescales by the wrong factor is far off the reference."""
    gen = torch.Generator().manual_seed(41 + splits)
    contexts, bs, kvh, d, group = [100, 257, 40, 1], 8, 2, 32, 4
    max_blocks = max(-(-c // bs) for c in contexts) + 1
    num_blocks = sum(-(-c // bs) for c in contexts) + 2
    kv = make_cache(gen, num_blocks, bs, kvh, d, torch.float32)
    tables = make_tables(gen, contexts, bs, max_blocks, num_blocks)
    q = torch.randn(len(contexts), group * kvh, d, generator=gen).to(DEV)
    unit = q.view(len(contexts), kvh, group, d).mean(2)  # [B, KVH, D]: each KV head's query heads lean along it
    unit = unit / unit.norm(dim=-1, keepdim=True)
    # K climbs along `unit`: on KV head 0 ~0.14 log2 a token (~4.5 a 32-token tile: a stale max reused), on KV
    # head 1 five times faster (a rescale every tile; p overflows float32 over the context unless rescaled)
    for b, ctx in enumerate(contexts):
        for t in range(ctx):
            blk, off = int(tables[b, t // bs]), t % bs
            kv[blk, 1, 0, off] += unit[b] * torch.tensor([0.2, 1.0], device=DEV)[:, None] * t
    kv, q = kv.to(dtype), q.to(dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEV)
    runs = {lazy: decode_attention(q, kv[:, 1], tables, lens, d ** -0.5, num_splits=splits,
                                   launch=decode_mod.AttentionLaunch(32, 4, 1, lazy=lazy)) for lazy in (False, True)}
    for b, ctx in enumerate(contexts):
        ref = reference(q[b:b + 1], kv[:, 1], tables[b], ctx, d ** -0.5, None)
        for out in runs.values():
            assert_close(out[b:b + 1], ref, dtype)


def test_decode_merge_in_chunks_and_semaphores_left_zero(monkeypatch):
    """The last split merges the others in chunks of 2 (a small merge tile): 9 splits of two 8-token blocks each
    (BLOCK_N 16), contexts with 9, 5 and 0 busy splits; the caller's semaphores are zero again after each call,
    so a second call with them (as a graph replay does) is right too."""
    monkeypatch.setattr(decode_mod, "launch_config", lambda *shape: (16, 4, 1))
    monkeypatch.setattr(decode_mod, "MERGE_TILE", 2 * 4 * 16)  # [GROUP 4, 2 splits, D 16]
    gen = torch.Generator().manual_seed(11)
    contexts, bs, kvh, d = [144, 73, 0], 8, 2, 16
    kv = make_cache(gen, 40, bs, kvh, d, torch.float32)
    tables = make_tables(gen, contexts, bs, 18, 40)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEV)
    q = torch.randn(3, 4 * kvh, d, generator=gen).to(DEV)
    semaphores = torch.zeros(4, kvh, dtype=torch.int32, device=DEV)
    for _ in range(2):
        out = decode_attention(q, kv[:, 1], tables, lens, 0.3, num_splits=9, out=torch.full_like(q, float("nan")),
                               semaphores=semaphores)
        assert (semaphores == 0).all(), "the kernel must leave its semaphores zero"
        assert (out[2] == 0).all()
        for b in (0, 1):
            assert_close(out[b:b + 1], reference(q[b:b + 1], kv[:, 1], tables[b], contexts[b], 0.3, None),
                         torch.float32)


# --- prefill -------------------------------------------------------------------------------------------------------

PREFILL_CASES = [
    # (group, kv_heads, head_dim, block_size, dtype, window, [(q_len, context), ...])
    # (45, 20): prefix-cache hit / chunked prefill; (33, 33): plain prompt; (1, 1) and (1, 17): one new token;
    # (16, 16): a multiple of the block size.
    pytest.param(1, 2, 32, 16, torch.float32, None, [(20, 45), (33, 33), (1, 1), (16, 16)], id="mha-bs16-fp32"),
    pytest.param(4, 2, 32, 8, torch.bfloat16, None, [(33, 33), (20, 45), (1, 17)], id="gqa4-bs8-bf16"),
    pytest.param(8, 1, 64, 16, torch.float16, None, [(5, 5), (40, 70), (16, 16)], id="gqa8-bs16-fp16"),
    pytest.param(4, 2, 32, 8, torch.float32, 10, [(37, 37), (20, 45), (1, 1)], id="gqa4-bs8-fp32-window"),
    # window 37 > BLOCK_M + BLOCK_N (16 + 16 interpreted): some tiles are seen whole by every row of an M block
    pytest.param(4, 1, 32, 32, torch.bfloat16, 37, [(50, 72), (64, 64), (9, 9)], id="gqa4-bs32-bf16-window"),
]


def run_prefill(group, kvh, d, bs, dtype, window, seqs, seed):
    gen = torch.Generator().manual_seed(seed)
    q_lens, contexts = [s[0] for s in seqs], [s[1] for s in seqs]
    heads, max_blocks = group * kvh, max(-(-c // bs) for c in contexts) + 1
    num_blocks = sum(-(-c // bs) for c in contexts) + 2
    kv = make_cache(gen, num_blocks, bs, kvh, d, dtype)
    tables = make_tables(gen, contexts, bs, max_blocks, num_blocks)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], heads + 2, d, generator=gen).to(dtype).to(DEV)[:, 2:]  # a strided view, as from QKV
    scale = d ** -0.5
    out = torch.full_like(q, float("nan"))

    got = prefill_attention(q, kv[:, 1], tables, torch.tensor(starts, dtype=torch.int32, device=DEV),
                            torch.tensor(contexts, dtype=torch.int32, device=DEV), max(q_lens), scale,
                            sliding_window=window, out=out)

    assert got is out
    for i, ctx in enumerate(contexts):
        rows = slice(starts[i], starts[i + 1])
        assert_close(out[rows], reference(q[rows], kv[:, 1], tables[i], ctx, scale, window), dtype)


@pytest.mark.parametrize("group,kvh,d,bs,dtype,window,seqs", PREFILL_CASES)
def test_prefill_matches_reference(group, kvh, d, bs, dtype, window, seqs):
    run_prefill(group, kvh, d, bs, dtype, window, seqs, seed=100 * group + 10 * bs + (window or 0))


@pytest.mark.parametrize("block_m,block_n", [(64, 32), (128, 64)])
def test_prefill_gpu_tile_sizes(monkeypatch, block_m, block_n):
    """The GPU tile shapes (interpreted runs default to 16 x 16), with a prefix, uneven q lengths and a window wide
    enough for unmasked tiles between its edge and the diagonal."""
    monkeypatch.setattr(prefill_mod, "_launch_config", lambda dtype, head_dim: (block_m, block_n, 4, 1))
    window = 2 * block_m + block_n
    run_prefill(2, 2, 16, 16, torch.float32, window, [(400, 400), (30, 130), (1, 9)], seed=block_m)


# --- argument checks -----------------------------------------------------------------------------------------------

def _decode_args():
    kv = torch.zeros(4, LAYERS, 2, 8, 2, 16, device=DEV)
    return dict(q=torch.zeros(2, 4, 16, device=DEV), kv_layer=kv[:, 1],
                block_tables=torch.zeros(2, 3, dtype=torch.int32, device=DEV),
                context_lens=torch.ones(2, dtype=torch.int32, device=DEV), scale=1.0, num_splits=2)


def _prefill_args():
    kv = torch.zeros(4, LAYERS, 2, 8, 2, 16, device=DEV)
    return dict(q=torch.zeros(5, 4, 16, device=DEV), kv_layer=kv[:, 1],
                block_tables=torch.zeros(2, 3, dtype=torch.int32, device=DEV),
                query_start=torch.tensor([0, 2, 5], dtype=torch.int32, device=DEV),
                context_lens=torch.tensor([2, 3], dtype=torch.int32, device=DEV), max_query_len=3, scale=1.0)


@pytest.mark.parametrize("name,bad", [
    ("q", lambda a: a["q"][0]),
    ("q", lambda a: a["q"].double()),
    ("kv_layer", lambda a: a["kv_layer"].half()),
    ("kv_layer", lambda a: a["kv_layer"][:, 0]),
    ("block_tables", lambda a: a["block_tables"].long()),
    ("block_tables", lambda a: a["block_tables"][:1]),
    ("context_lens", lambda a: a["context_lens"][:1]),
    ("context_lens", lambda a: a["context_lens"].float()),
    ("out", lambda a: torch.zeros_like(a["q"]).half()),
    ("sliding_window", lambda a: 0),
    ("num_splits", lambda a: 0),
    ("semaphores", lambda a: torch.zeros(2, 3, dtype=torch.int32, device=DEV)),
    ("semaphores", lambda a: torch.zeros(2, 2, device=DEV)),
])
def test_decode_rejects_bad_arguments(name, bad):
    args = _decode_args()
    args[name] = bad(args)
    with pytest.raises(ValueError, match=rf"^{name} "):
        decode_attention(**args)


@pytest.mark.parametrize("name,bad", [
    ("q", lambda a: a["q"][:, :, None]),
    ("kv_layer", lambda a: a["kv_layer"].bfloat16()),
    ("block_tables", lambda a: a["block_tables"][0]),
    ("query_start", lambda a: a["query_start"][:2]),
    ("query_start", lambda a: a["query_start"].long()),
    ("context_lens", lambda a: a["context_lens"].long()),
    ("max_query_len", lambda a: -1),
    ("out", lambda a: torch.zeros(5, 4, 8, device=DEV)),
    ("sliding_window", lambda a: -3),
])
def test_prefill_rejects_bad_arguments(name, bad):
    args = _prefill_args()
    args[name] = bad(args)
    with pytest.raises(ValueError, match=rf"^{name} "):
        prefill_attention(**args)


# --- real sizes on a GPU -------------------------------------------------------------------------------------------

def _time_ms(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (read + write) of a 1 GiB copy."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (_time_ms(lambda: dst.copy_(src)) / 1e3)


def _matmul_rate() -> float:
    """bf16 matmul flop/s of an 8192^3 torch matmul."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    return 2 * 8192**3 / (_time_ms(lambda: a @ a, iters=10) / 1e3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_real_size_on_gpu():
    """Llama-3-8B shape, batch 64, 4k context, bf16: correctness, CUDA-graph replay, and bandwidth (printed)."""
    gen = torch.Generator().manual_seed(0)
    batch, ctx, heads, kvh, d, bs = 64, 4096, 32, 8, 128, 16
    nb = ctx // bs
    kv = make_cache(gen, batch * nb + 8, bs, kvh, d, torch.bfloat16)
    tables = make_tables(gen, [ctx] * batch, bs, nb, batch * nb + 8)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, heads, d, generator=gen).bfloat16().to(DEV)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kv[:, 1], tables, lens, d ** -0.5, out=out)
    for b in (0, 37, 63):
        assert_close(out[b:b + 1], reference(q[b:b + 1], kv[:, 1], tables[b], ctx, d ** -0.5, None), torch.bfloat16)

    # graph safety: captured once, replayed with other context lengths
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, kv[:, 1], tables, lens, d ** -0.5, out=out)
    lens.copy_(torch.randint(0, ctx + 1, (batch,), generator=gen, dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    for b in (1, 2, 40):
        c = int(lens[b])
        if c:
            assert_close(out[b:b + 1], reference(q[b:b + 1], kv[:, 1], tables[b], c, d ** -0.5, None), torch.bfloat16)
        else:
            assert (out[b] == 0).all()

    lens.fill_(ctx)
    ms = _time_ms(lambda: decode_attention(q, kv[:, 1], tables, lens, d ** -0.5, out=out))
    kv_bytes = batch * ctx * kvh * d * 2 * 2
    frac = kv_bytes / (ms / 1e3) / _copy_bandwidth()
    print(f"\ndecode B={batch} ctx={ctx}: {ms:.3f} ms, {kv_bytes / ms / 1e6:.0f} GB/s, {frac:.2f} of copy bandwidth")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_real_size_on_gpu():
    """A 2k-token prompt plus 8 x 512 (one of them after a 1024-token cached prefix), 8B shape, bf16: correctness
    and the fraction of bf16 matmul rate (printed)."""
    gen = torch.Generator().manual_seed(1)
    heads, kvh, d, bs = 32, 8, 128, 16
    seqs = [(2048, 2048)] + [(512, 512)] * 7 + [(512, 1536)]
    q_lens, contexts = [s[0] for s in seqs], [s[1] for s in seqs]
    num_blocks = sum(c // bs for c in contexts) + 4
    kv = make_cache(gen, num_blocks, bs, kvh, d, torch.bfloat16)
    tables = make_tables(gen, contexts, bs, max(contexts) // bs, num_blocks)
    starts = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEV)
    q = torch.randn(sum(q_lens), heads, d, generator=gen).bfloat16().to(DEV)
    out = torch.full_like(q, float("nan"))

    def run():
        return prefill_attention(q, kv[:, 1], tables, starts, lens, max(q_lens), d ** -0.5, out=out)

    run()
    for i in (0, 8):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        assert_close(out[rows], reference(q[rows], kv[:, 1], tables[i], contexts[i], d ** -0.5, None),
                     torch.bfloat16)
    ms = _time_ms(run)
    flops = sum(4 * heads * d * (n * (c - n) + n * (n + 1) // 2) for n, c in seqs)  # QK^T and PV, causal
    frac = flops / (ms / 1e3) / _matmul_rate()
    print(f"\nprefill {sum(q_lens)} tokens: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s, {frac:.2f} of matmul rate")
