"""The one-shot all-reduce of small tensors over NVLink, measured against NCCL and not shipped in the engine.

torch's symmetric-memory kernel (`torch.ops.symm_mem.one_shot_all_reduce_out`), which each rank runs on its own
stream: copy the input into its symmetric buffer, a barrier through peer-mapped signal pads, read every peer's
buffer and add, and a closing barrier (so the buffer may be rewritten by the next call). Issue 12 asked whether it
beats NCCL for a decode step's small messages at TP=2 and to ship it only if it measurably wins. Over the engine's
TP groups on rank 0's TCP store it does not: 7.5 / 8.8 / 10.9 us against NCCL's 7.3 / 8.8 / 11.3 us at 1 / 16 /
64 x 4096 bf16 inside a CUDA graph on two H200s (`benchmarks/tp_scaling_gpu.py --all-reduce-only`,
docs/benchmarks.md), and the 8B TP=2 decode step did not change with it. (Over the file store the groups used
before, NCCL took ~25 us and this kernel won threefold.) So the engine sums with NCCL only, and this module serves
the benchmark that keeps that comparison reproducible.

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
    """The one-shot all-reduce over the NCCL `backend` of a TP group. Raises RuntimeError on every rank where
    symmetric memory cannot be set up on any (no peer access between the GPUs, an unsupported driver or dtype).
    The ranks agree on the outcome through one NCCL all-reduce of a flag: a rank that failed while another
    succeeded would otherwise leave the other waiting in its first all-reduce. `name`: the group's, unique in the
    process (torch's registry of groups is process-wide)."""
    one_shot, why = None, ""
    try:
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"torch's one-shot kernel sums bfloat16 and float32, not {dtype}")
        import torch.distributed._symmetric_memory as symm_mem
        group = _register_group(name, backend, store, rank, size)
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
    raise RuntimeError(f"tensor-parallel rank {rank} could not set up the symmetric memory of the one-shot "
                       f"all-reduce ({why or 'another rank failed'})")


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
