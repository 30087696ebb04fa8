"""MixedGraphs: piecewise CUDA graphs of steps that carry prompt chunks (mixed with decodes, or prefill-only), one
set per token bucket: everything between two attention calls is a captured piece, attention itself runs eagerly.

Why: on a fast model the host is the bottleneck. A step with a prompt chunk ran the whole forward eagerly (about ten
launches a layer from Python, ~3 ms of host time on the 1B shape), where a decode-only step replays one graph; in a
served closed loop prompts arrive one by one, so many steps carry a chunk (docs/benchmark-log.md, 2026-11-27). The
attention of such a step depends on its sequences (their number, lengths and block tables), which a graph cannot
follow; every other op depends only on the token count. So each bucket of T tokens has L + 1 graphs:
- piece 0: embedding, layer 0's input norm and q/k/v projection, RoPE and the K/V store (into the cache);
- piece i (1..L-1): layer i-1's o-projection, post-attention norm and MLP, then layer i's part before attention;
- piece L: layer L-1's part after attention and the final norm -> the hidden states.
Between pieces `attend` runs on the step's real rows with the step's own metadata, reading q from and writing its
output into static buffers the pieces share. Rows past the step's own are padding: slot -1 (their K/V is not
stored), position 0; they never reach attention and every other op is row by row, so they never touch real rows.
Owns the static buffers and the graphs; the KV cache is the engine's. Used by ModelRunner.forward, alike on every
tensor-parallel rank (the pieces hold the TP all-reduces; the choice depends on the token count only).
With `deferred` (tensor_parallel_size 1) no bucket is captured at start: `capture_pending` captures them between
steps, smallest first; until then a step takes the smallest captured bucket that holds it, or runs eagerly.
"""

from __future__ import annotations

import torch

from engine.model.attention_metadata import AttentionMetadata
from engine.model.decoder import CausalLM
from engine.model.decoder_layer import RopeInputs
from engine.runner.graph_capture import DeferredCaptures, capture_graph

FIRST_BUCKETS = (64, 128, 256)
STEP = 256  # bucket spacing above the first ones: padding costs at most this many rows of GEMM


def mixed_buckets(max_tokens: int) -> list[int]:
    """64, 128, 256, then every multiple of 256 up to max_tokens, and max_tokens itself."""
    sizes = [b for b in FIRST_BUCKETS if b < max_tokens] + list(range(2 * STEP, max_tokens, STEP))
    return sorted(set(sizes + [max_tokens])) if max_tokens > 0 else []


class MixedGraphs:
    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, max_tokens: int, capture: bool = True,
                 deferred: bool = False) -> None:
        """`capture=False` runs the pieces eagerly instead of replaying them (a CPU test of the decomposition).
        `deferred`: capture nothing now (see the module docstring)."""
        cfg, dev, dtype = model.config, kv_cache.device, model.model.embed_tokens.weight.dtype  # activations
        self.model, self.kv_cache = model, kv_cache
        self.buckets = mixed_buckets(max_tokens)
        self.layers = model.model.layers
        t = max(self.buckets, default=0)
        self.input_ids = torch.zeros(t, dtype=torch.int32, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int32, device=dev)
        self.slots = torch.full((t,), -1, dtype=torch.int32, device=dev)
        self.q = torch.zeros(t, cfg.num_heads, cfg.head_dim, dtype=dtype, device=dev)    # [T, H, D] attention in
        self.o = torch.zeros(t, cfg.num_heads, cfg.head_dim, dtype=dtype, device=dev)    # [T, H, D] attention out
        self.residual = torch.zeros(t, cfg.hidden_size, dtype=dtype, device=dev)          # [T, hidden]
        self.hidden = torch.zeros(t, cfg.hidden_size, dtype=dtype, device=dev)            # [T, hidden] final
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.replays = 0
        self.capturing = capture
        self.deferred = DeferredCaptures(self.buckets if capture and deferred else [])
        if capture and not deferred:
            self._capture()

    def bucket_for(self, num_tokens: int) -> int | None:
        """The smallest bucket holding `num_tokens` whose pieces are captured (all of them without capturing)."""
        return next((b for b in self.buckets if b >= num_tokens and (not self.capturing or b in self.graphs)), None)

    @torch.inference_mode()
    def capture_pending(self) -> bool:
        """Capture the next pending bucket's pieces (between two steps; all slots made padding first: the warm-up
        runs store K/V at the static slots, which still hold the last step's); False when none is left."""
        n = self.deferred.take()
        if n is None:
            return False
        self.slots.fill_(-1)

        def capture() -> None:  # graphs[n] set only once every piece is captured: a step never meets half a set
            self.graphs[n] = [capture_graph(lambda i=i: self._piece(i, n), self.deferred.memory_pool(),
                                            self.deferred.stream())[0] for i in range(len(self.layers) + 1)]

        self.deferred.attempt(n, capture, f"mixed-step graphs of {n} tokens",
                              "such steps run in a larger bucket or eagerly")
        return True

    @torch.inference_mode()
    def run(self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """A step of T <= bucket tokens -> final hidden states [T, hidden] (a view valid until the next run).
        input_ids, positions [T] and meta are the step's device tensors."""
        t = input_ids.shape[0]
        if t > bucket or bucket not in self.buckets:
            raise ValueError(f"no mixed-step graph of {bucket} tokens holds a step of {t}")
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slots[:t].copy_(meta.slots)
        self.slots[t:bucket].fill_(-1)
        self.positions[t:bucket].zero_()
        pieces = self.graphs.get(bucket)
        for i in range(len(self.layers) + 1):
            if pieces is not None:
                pieces[i].replay()
            else:  # capture=False
                self._piece(i, bucket)
            if i < len(self.layers):
                self.layers[i].self_attn.attend(self.q[:t], self.kv_cache[:, i], meta, out=self.o[:t])
        self.replays += 1
        return self.hidden[:t]

    def _piece(self, i: int, n: int) -> None:
        """Piece i of the bucket of n tokens (see the module docstring), over the static buffers."""
        rope = RopeInputs(self.positions[:n], self.model.rope.cos, self.model.rope.sin)
        if i == 0:
            x, residual = self.model.model.embed_tokens(self.input_ids[:n]), None
        else:
            x, residual = self.layers[i - 1].after_attention(self.o[:n], self.residual[:n])
        if i == len(self.layers):
            self.hidden[:n].copy_(self.model.model.norm(x, residual)[0])
            return
        q, residual = self.layers[i].before_attention(x, residual, rope, self.kv_cache[:, i], self.slots[:n])
        self.q[:n].copy_(q)
        if residual.data_ptr() != self.residual.data_ptr():  # piece 0's is the embedding; later ones add in place
            self.residual[:n].copy_(residual)

    @torch.inference_mode()
    def _capture(self) -> None:
        # The slots are all -1 before the first step: capturing stores no K/V.
        pool, stream = self.deferred.memory_pool(), self.deferred.stream()
        for n in sorted(self.buckets, reverse=True):  # largest first: smaller ones reuse its memory
            self.graphs[n] = [capture_graph(lambda i=i, n=n: self._piece(i, n), pool, stream)[0]
                              for i in range(len(self.layers) + 1)]
        torch.cuda.synchronize()
