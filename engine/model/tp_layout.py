"""TPLayout: which part of every weight, head and vocabulary row a tensor-parallel rank holds (engine.model.parallel
describes the cut); pure arithmetic over the model config, so a process that only checks a config (the
coordinator) imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.kv_heads import KVHeadRange
from engine.model.model_config import ModelConfig

FIELD = "EngineConfig.tensor_parallel_size"


@dataclass(frozen=True)
class TPLayout:
    """Which part of every weight rank `rank` of `size` holds (pure arithmetic over the model config)."""

    cfg: ModelConfig
    rank: int
    size: int

    @staticmethod
    def check(cfg: ModelConfig, size: int) -> None:
        """Raise ValueError naming the field when the model cannot be split over `size` ranks."""
        if size < 1:
            raise ValueError(f"{FIELD} must be at least 1, got {size}")
        kvh = cfg.num_kv_heads
        problems = [
            (cfg.num_heads % size, f"the model's {cfg.num_heads} attention heads"),
            (kvh % size if kvh >= size else size % kvh,
             f"the model's {kvh} KV heads (or be a multiple of them, to replicate them)"),
            (cfg.intermediate_size % size, f"the model's intermediate_size {cfg.intermediate_size}"),
        ]
        for bad, what in problems:
            if bad:
                raise ValueError(f"{FIELD} {size} must divide {what}")

    @property
    def heads(self) -> int:
        return self.cfg.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        return max(1, self.cfg.num_kv_heads // self.size)

    @property
    def kv_head_range(self) -> KVHeadRange:
        """The global KV heads this rank's cache holds (engine.kv_heads: the transfer layer's contract)."""
        return KVHeadRange.for_rank(self.cfg.num_kv_heads, self.size, self.rank)

    @property
    def intermediate(self) -> int:
        return self.cfg.intermediate_size // self.size

    @property
    def vocab_rows(self) -> int:
        return -(-self.cfg.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        start = min(self.rank * self.vocab_rows, self.cfg.vocab_size)
        return start, min(start + self.vocab_rows, self.cfg.vocab_size)

    def local_config(self) -> ModelConfig:
        """The config the rank's layers are built from (vocab_size stays global: the gathered logits' width)."""
        return replace(self.cfg, num_heads=self.heads, num_kv_heads=self.kv_heads,
                       intermediate_size=self.intermediate)

    def slices(self) -> dict[str, tuple[int, int, int, int]]:
        """Checkpoint tensor name -> (dim, start, stop, full size along dim) of this rank's part; names absent
        are replicated (read whole)."""
        d, h = self.cfg.head_dim, self.heads
        kv0 = self.kv_head_range.start
        q = (0, self.rank * h * d, (self.rank + 1) * h * d, self.cfg.num_heads * d)
        kv = (0, kv0 * d, (kv0 + self.kv_heads) * d, self.cfg.num_kv_heads * d)
        inter = self.intermediate
        up = (0, self.rank * inter, (self.rank + 1) * inter, self.cfg.intermediate_size)
        down = (1, *up[1:])
        o = (1, *q[1:])
        vocab = (0, *self.vocab_range, self.cfg.vocab_size)
        out = {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab}
        for i in range(self.cfg.num_layers):
            p = f"model.layers.{i}."
            for name, cut in (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv),
                              ("mlp.gate_proj", up), ("mlp.up_proj", up)):
                out[p + name + ".weight"] = cut
                out[p + name + ".bias"] = cut
            out[p + "self_attn.o_proj.weight"] = o
            out[p + "mlp.down_proj.weight"] = down  # its bias (if any) is replicated and added once
        return out
