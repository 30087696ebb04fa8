"""The test files `bash benchmarks/gpu_run.sh tests` runs on a lent GPU, one per line: the FP8 ones first, then every
other module that marks tests `gpu` or `gpus(n)` (tests/test_gpu_markers.py keeps every CUDA-using module marked).

`python3 -m tests.gpu_test_files [--part I/N]`: with --part, every N-th file from the I-th, so that N calls on one warm
machine run the whole suite when it would outrun one call (the device tool stops a command at 600 s; the suite took
more than 470 s on a fresh H100 at 54da3ff, its Triton cache empty).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MARKED = re.compile(r"pytest\.mark\.gpus?\b")


def gpu_test_files() -> list[str]:
    """Paths relative to the repository root: tests/test_fp8_*.py and tests/test_kv_fp8_*.py, then the other
    test modules that mark a test gpu, each once, in name order."""
    fp8 = sorted(TESTS.glob("test_fp8_*.py")) + sorted(TESTS.glob("test_kv_fp8_*.py"))
    marked = [p for p in sorted(TESTS.glob("test_*.py")) if p not in fp8 and MARKED.search(p.read_text())]
    return [f"tests/{p.name}" for p in fp8 + marked]


def part(files: list[str], text: str) -> list[str]:
    """Part I of N ("I/N", 1 <= I <= N): files I, I + N, I + 2N, ... (1-based); a ValueError naming the text."""
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ValueError(f"--part {text!r}: expected I/N with 1 <= I <= N, e.g. 1/2")
    i, n = int(m.group(1)), int(m.group(2))
    return files[i - 1::n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default=None, help="I/N: every N-th file from the I-th")
    args = parser.parse_args()
    files = gpu_test_files()
    if args.part is not None:
        try:
            files = part(files, args.part)
        except ValueError as e:
            parser.error(str(e))
    print("\n".join(files))


if __name__ == "__main__":
    main()
