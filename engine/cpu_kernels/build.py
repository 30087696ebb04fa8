"""Building a C source of this folder into a shared library for this CPU, once per machine, and loading it.

Owns the compile (the system's C compiler, `-march=native`), the cache (the pdserve cache folder, keyed by the
source, the compiler, the flags and the CPU's flags; written to a temporary name and renamed, so concurrent workers
never load half a file) and the refusal: without a compiler, on a non-Linux host or if the build fails, `build`
returns None and logs why once, and the caller keeps its torch path. No torch headers: a build takes about a second.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from engine.tiny import default_cache_dir

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-shared", "-fPIC"]  # fast-math: vector expf


def build(source: Path, what: str, flags: Sequence[str] = (), libs: Sequence[str] = ()) -> ctypes.CDLL | None:
    """`source` compiled and loaded, or None (logged, naming `what`) where it cannot be built here. `flags` follow
    FLAGS (a later one overrides: "-fno-fast-math"); `libs` are linker arguments after the source."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None or platform.system() != "Linux":
        log.warning("no C compiler (cc): %s stays on the torch path", what)
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
        key = hashlib.sha256(source.read_bytes() + version.encode() + " ".join([*FLAGS, *flags, *libs]).encode()
                             + _cpu_flags().encode()).hexdigest()[:16]
        target = default_cache_dir() / "cpu_kernels" / f"{source.stem}-{key}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                subprocess.run([compiler, *FLAGS, *flags, "-o", str(built), str(source), *libs, "-lmvec", "-lm"],
                               check=True, capture_output=True, text=True)
                os.replace(built, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr if isinstance(e, subprocess.CalledProcessError) else e
        log.warning("%s not built (%s): staying on the torch path", what, detail)
        return None


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""
