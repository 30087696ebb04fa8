"""The one-shot all-reduce of small tensors over NVLink: torch's symmetric-memory kernel
(`torch.ops.symm_mem.one_shot_all_reduce_out`), which each rank runs on its own stream: copy the input into its
symmetric buffer, then a barrier through peer-mapped signal pads, read every peer's buffer and add, and a closing
barrier (so the buffer may be rewritten by the next call). For a decode step's messages (batch x hidden, a few KB
to 1 MB) it costs a third to a half of NCCL's latency through the same TP group inside a CUDA graph on two H200s:
7.6 us against 22.9 us at 8 KB, 11.2 against 24.6 us at 512 KB (benchmarks/tp_gpu.py scaling --all-reduce-only,
docs/benchmark-log.md). Larger tensors go to NCCL. NCCL's latency for these messages varied between runs on the same
kind of machine (7 to 61 us at 8 KB), this kernel's did not (7.6 us); in one call the 8B shape's TP=2 decode step
took 3.252 ms with it against 3.517 ms with NCCL alone at batch 1 (1.081x) and 6.386 against 6.709 ms at batch 64
(1.051x). It is not the default, though: after a TP engine with it had closed, the next TP engine in the same
process hung on two H200s, once in its set-up (holding the GIL) and once, with NCCL alone (float16, "auto" falling
back), in its close's pg.abort(); not yet understood. So it is opt-in
(EngineConfig.tp_all_reduce "auto": where every rank can set it up, else NCCL alone; "one_shot": required) for a
process that builds one TP engine, as a serving worker does; tests/test_tp_cuda.py checks the engine with it once.

Owns the symmetric buffer of one TP group on one rank and the group's registration under a name (torch's kernel
looks the group up by name); `open_one_shot` is collective: every rank of the group calls it at start-up, in the
same order as the group's other collectives. For two ranks the sum is a + b in the tensor's dtype, as NCCL's, so
outputs do not change with the choice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ONE_SHOT_MAX_BYTES = 1 << 20  # a decode batch of 64 at hidden 8192 in bf16; larger messages: NCCL


class OneShotAllReduce:
    def __init__(self, buffer: torch.Tensor, group_name: str, group) -> None:
        self.buffer = buffer          # [max elements] symmetric memory, rendezvoused over the group
        self.group_name = group_name
        self.group = group            # the registered c10d group: torch's registry holds only a weak reference

    def close(self) -> None:
        """Drop the group's registration (torch's registry is process-wide); the buffer goes with this object."""
        from torch._C._distributed_c10d import _unregister_process_group
        _unregister_process_group(self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.buffer.dtype and x.is_contiguous() and 0 < x.numel() <= self.buffer.numel()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks into x (in place); returns x."""
        flat = x.view(-1)
        staged = self.buffer[: flat.numel()]
        staged.copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out=flat)
        return x


def open_one_shot(backend, store, rank: int, size: int, device: torch.device, dtype: torch.dtype,
                  name: str) -> OneShotAllReduce:
    """The one-shot all-reduce over the NCCL `backend` of a TP group. Raises RuntimeError naming
    EngineConfig.tp_all_reduce on every rank where symmetric memory cannot be set up on any (no peer access between
    the GPUs, an unsupported driver or dtype).
    The ranks agree on the outcome through one NCCL all-reduce of a flag: a rank that failed while another
    succeeded would otherwise leave the other waiting in its first all-reduce. `name`: the group's, unique in the
    process (torch's registry of groups is process-wide)."""
    one_shot, why, registered = None, "", False
    try:
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"torch's one-shot kernel sums bfloat16 and float32, not {dtype}")
        import torch.distributed._symmetric_memory as symm_mem
        group = _register_group(name, backend, store, rank, size)
        registered = True
        buffer = symm_mem.empty(ONE_SHOT_MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, name)
        one_shot = OneShotAllReduce(buffer, name, group)
    except Exception as e:  # noqa: BLE001 - reported below, after the ranks agree
        why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    ok = torch.tensor([0 if one_shot is None else 1], dtype=torch.int32, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    backend.allreduce([ok], opts).wait()
    if int(ok.item()) == 1:
        assert one_shot is not None
        return one_shot
    if registered:  # the registry is process-wide: a group NCCL alone will serve must not stay in it
        from torch._C._distributed_c10d import _unregister_process_group
        _unregister_process_group(name)
    raise RuntimeError(f"EngineConfig.tp_all_reduce: tensor-parallel rank {rank} could not set up the symmetric "
                       f"memory of the one-shot all-reduce ({why or 'another rank failed'})")


def _register_group(name: str, backend, store, rank: int, size: int):
    """Make the group known to torch's symmetric memory under `name`: a c10d ProcessGroup over the NCCL backend."""
    from torch._C._distributed_c10d import _register_process_group
    prefix = dist.PrefixStore(f"{name}/", store)
    group = dist.ProcessGroup(prefix, rank, size)
    group._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
    group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    group._set_group_name(name)
    _register_process_group(name, group)
    return group
