"""How the process's C allocator (glibc malloc) treats the large host buffers a CPU engine allocates every step.

glibc serves blocks above its mmap threshold (128 KiB at start, raised only as such blocks are freed) with a fresh
mmap and unmaps them on free, so each large activation of a prefill step (tiny's [1536, 1376] gate/up output:
4 MiB) came back as new pages, faulted in one by one: ~18% of a 1,536-token prefill step on the 2-core machine.
`keep_freed_memory()` raises the threshold to glibc's maximum and the trim threshold with it, so freed buffers stay
in the heap for the next step; the process's resident memory then stays at its peak, as a serving process's does
anyway. Process-wide; a no-op (False) where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 256 << 20


def keep_freed_memory() -> bool:
    """Keep freed blocks up to 32 MiB in the heap instead of unmapping them; True if glibc took the settings."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        log.warning("mallopt refused the CPU engine's allocator settings: large buffers stay mmapped")
    return ok
