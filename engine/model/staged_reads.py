"""StagedReader: one safetensors file's tensors read straight into CUDA memory, through two pinned buffers.

The plain path (safetensors' `get_slice(...)[:]`, then `copy_` into the GPU parameter) makes a pageable CPU copy of
every tensor from the memory map, page fault by page fault, and the device copy from pageable memory goes through
the driver's own bounce buffer, one tensor after the other. Here the file is read with `os.preadv` (the page cache
copied once, by several threads: the GIL is released while they read) into a pinned buffer, whose device copy is
queued without blocking while the next chunk is read into the other buffer. A tensor whose stored dtype is its
parameter's lands in the parameter itself; another (a float32 file for a bfloat16 model) in a temporary of the
stored dtype on the device, converted there by the caller.

Owns: the file's header (names -> dtype, shape, byte range, checked against the file's size), the descriptor, the
two buffers and their events. engine.model.weights decides which tensors come this way (whole tensors for a CUDA
model; tensor-parallel slices and FP8 scales take the plain path) and checks each one as before.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engine.config_error import ConfigError

CHUNK_BYTES = 64 << 20  # per pinned buffer (two of them)
READERS = 4             # threads reading one chunk's parts
MIN_PART_BYTES = 4 << 20
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class StagedReader:
    def __init__(self, path: Path, device: torch.device) -> None:
        self.path, self.device = path, device
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ConfigError(f"{path}: not a safetensors file (header of {n} bytes in a {size}-byte file)")
            header = json.loads(f.read(n))
        self.base = 8 + n
        self.entries: dict[str, dict] = {k: v for k, v in header.items() if k != "__metadata__"}
        for name, e in self.entries.items():
            begin, end = e["data_offsets"]
            if e.get("dtype") not in DTYPES or not 0 <= begin <= end or self.base + end > size:
                raise ConfigError(f"{path}: tensor {name!r} has dtype {e.get('dtype')!r} and bytes {begin}..{end} "
                                  f"past the data's {size - self.base}: the file is truncated or not safetensors")
        self.fd = os.open(path, os.O_RDONLY)
        self.buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]  # each buffer's last device copy
        self.turn = 0
        self.pool = ThreadPoolExecutor(READERS, thread_name_prefix="weights-read")

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        e = self.entries[name]
        return DTYPES[e["dtype"]], tuple(e["shape"])

    def read(self, name: str, target: torch.Tensor) -> torch.Tensor:
        """Tensor `name` (its shape already checked against `target`, a CUDA tensor) on the device: `target` itself
        where it is contiguous in the stored dtype, else a temporary of the stored dtype for the caller to copy."""
        dtype, shape = self.meta(name)
        dest = target if dtype == target.dtype and target.is_contiguous() else torch.empty(
            shape, dtype=dtype, device=target.device)
        if dest.numel():
            self._read_into(name, dest.view(-1).view(torch.uint8))
        return dest

    def close(self) -> None:
        for event in self.copied:
            if event is not None:
                event.synchronize()  # the buffers are freed with this reader
        self.pool.shutdown()
        os.close(self.fd)

    def __enter__(self) -> StagedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_into(self, name: str, dest: torch.Tensor) -> None:
        """The entry's bytes into `dest` (a contiguous uint8 CUDA tensor of its size), chunk by chunk: each chunk
        read into the buffer whose previous device copy has ended, then copied on the current stream."""
        begin, end = self.entries[name]["data_offsets"]
        done = 0
        while done < end - begin:
            n = min(CHUNK_BYTES, end - begin - done)
            i, self.turn = self.turn, 1 - self.turn
            if self.copied[i] is not None:
                self.copied[i].synchronize()
            buffer = self.buffers[i][:n]
            self._pread(buffer, self.base + begin + done)
            dest[done:done + n].copy_(buffer, non_blocking=True)
            self.copied[i] = torch.cuda.Event()
            self.copied[i].record()
            done += n

    def _pread(self, buffer: torch.Tensor, offset: int) -> None:
        """Fill `buffer` (pinned, uint8) from the file at `offset`, its parts read by the pool's threads."""
        view = memoryview(buffer.numpy())
        n = len(view)
        parts = max(1, min(READERS, n // MIN_PART_BYTES))
        bounds = [n * k // parts for k in range(parts + 1)]
        list(self.pool.map(lambda k: self._pread_exact(view[bounds[k]:bounds[k + 1]], offset + bounds[k]),
                           range(parts)))

    def _pread_exact(self, view: memoryview, offset: int) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(self.fd, [view[got:]], offset + got)
            if n <= 0:
                raise ConfigError(f"{self.path}: the file ended at byte {offset + got}: truncated")
            got += n
