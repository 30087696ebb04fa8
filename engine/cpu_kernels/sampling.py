"""The sampler's draw on the CPU (sampling.c): greedy argmax and the exponential race of
engine.sampling.sampler in one C pass per row, the same bits as the torch path (its exp and log are the SLEEF
functions torch's vectorized ops call, linked from libtorch_cpu). On `tiny` at temperature 1, 16 rows: 0.70 ms of
torch ops -> 0.12 ms (a sixth of a decode step).

Owns loading the library (`load`: None without a C compiler, AVX-512, or where torch's own CPU kernels are not
its AVX-512 ones, whose SLEEF calls the kernel matches) and the call (`sample_rows`). The Sampler calls it for CPU
logits and keeps its torch path for a call it declines (a NaN or an infinite maximum in some row).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.cpu_kernels.build import build

SOURCE = Path(__file__).with_name("sampling.c")
_NO_AVX512 = 2


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot run here (logged by build, or silently: no AVX-512)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    torch_lib = Path(torch.__file__).parent / "lib"
    lib = build(SOURCE, "CPU sampling", flags=("-fno-fast-math",),
                libs=(f"-L{torch_lib}", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"))
    if lib is None:
        return None
    ptr = ctypes.c_void_p
    lib.sample_rows.argtypes = [ptr, ctypes.c_int64, ctypes.c_int64, ptr, ptr, ptr]
    lib.sample_rows.restype = ctypes.c_int
    if lib.sample_rows(None, 0, 0, None, None, None) == _NO_AVX512:
        return None
    return lib


def sample_rows(logits: torch.Tensor, packed: torch.Tensor | None, keep: torch.Tensor | None) -> torch.Tensor | None:
    """logits [S, V] float32; packed [S, 6] int64 (engine.sampling.sampler._pack; None: every row greedy); keep
    [S, V] bool (the filters' survivors; None: no filter) -> tokens [S] int64, or None where some row needs the
    torch path (a NaN logit, or an infinite maximum)."""
    if logits.dtype != torch.float32 or logits.ndim != 2:
        raise ValueError(f"sample_rows: logits must be [S, V] float32, got {tuple(logits.shape)} {logits.dtype}")
    rows, vocab = logits.shape
    if packed is not None and (packed.dtype != torch.int64 or tuple(packed.shape) != (rows, 6)):
        raise ValueError(f"sample_rows: packed must be [{rows}, 6] int64, got {tuple(packed.shape)} {packed.dtype}")
    if keep is not None and (keep.dtype != torch.bool or tuple(keep.shape) != (rows, vocab)):
        raise ValueError(f"sample_rows: keep must be [{rows}, {vocab}] bool, got {tuple(keep.shape)} {keep.dtype}")
    logits = logits.contiguous()
    packed = None if packed is None else packed.contiguous()
    keep = None if keep is None else keep.contiguous()
    tokens = torch.empty(rows, dtype=torch.int64)
    declined = load().sample_rows(logits.data_ptr(), rows, vocab, None if packed is None else packed.data_ptr(),
                                  None if keep is None else keep.data_ptr(), tokens.data_ptr())
    return None if declined else tokens
