"""No GPU path left unrun: every test module that can run on a CUDA device carries the `gpu` (or `gpus(n)`) marker,
so `bash benchmarks/gpu_run.sh tests` (pytest -m gpu) runs it on the lent GPU; and a test skipped for want of
devices is named in the run's summary (tests/conftest.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu_test_files import MARKED, gpu_test_files, part

TESTS = Path(__file__).resolve().parent
# naming CUDA, or importing another test module's device choice (CUDA, DEV, DEVICE)
NAMES_CUDA = re.compile(r"torch\.cuda\.is_available\(\)|device_count\(\)|device=\"cuda\"|\.cuda\(\)"
                        r"|^\s+(CUDA|DEV|DEVICE),$", re.M)


def test_every_module_that_can_use_cuda_is_marked():
    texts = {p.name: p.read_text() for p in sorted(TESTS.glob("test_*.py")) if p.name != Path(__file__).name}
    unmarked = [name for name, text in texts.items() if NAMES_CUDA.search(text) and not MARKED.search(text)]
    assert not unmarked, f"mark these pytest.mark.gpu (or gpus(n)) so the GPU run includes them: {unmarked}"


def test_tests_needing_more_devices_are_skipped_by_name(tmp_path):
    (tmp_path / "test_two.py").write_text("import pytest\n\n@pytest.mark.gpus(64)\ndef test_needs_many():\n"
                                          "    raise AssertionError('ran without its devices')\n")
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                          str(tmp_path / "test_two.py")], capture_output=True, text=True, cwd=TESTS.parent,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 skipped" in run.stdout and "test_two.py::test_needs_many: needs 64 CUDA device(s)" in run.stdout


def test_the_gpu_run_lists_every_marked_module_once_and_its_parts_partition_it():
    """tests/gpu_test_files.py (what `gpu_run.sh tests` collects): every marked module, the FP8 ones first; the parts
    of TESTS_PART=I/N together are the whole list, each file in one part; a bad part is refused by name."""
    files = gpu_test_files()
    marked = {f"tests/{p.name}" for p in TESTS.glob("test_*.py") if MARKED.search(p.read_text())}
    assert len(files) == len(set(files)) and set(files) >= marked
    fp8 = [f for f in files if f.startswith(("tests/test_fp8_", "tests/test_kv_fp8_"))]
    assert files[:len(fp8)] == fp8 and "tests/test_pdl.py" in files
    for n in (1, 2, 3):
        parts = [part(files, f"{i}/{n}") for i in range(1, n + 1)]
        assert sorted(f for p in parts for f in p) == sorted(files)
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    for bad in ("0/2", "3/2", "1/0", "half", "1/2/3"):
        with pytest.raises(ValueError, match="expected I/N"):
            part(files, bad)
