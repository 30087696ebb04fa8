"""Shared fixtures: tiny Hugging Face checkpoints built once per session.

Without a GPU, Triton kernels run in Triton's interpreter (set before any kernel module is imported).

GPU markers (pyproject.toml): `gpu` marks a test that runs a GPU path on a CUDA device when one is there (kernels
compiled rather than interpreted, FP8 tensor cores, CUDA graphs); `gpus(n)` a test that needs n devices, skipped
here with that reason where fewer are present, never run through a CPU fallback. `bash benchmarks/gpu_run.sh tests`
runs every `gpu` test; the summary names each test skipped for want of devices (pytest_terminal_summary).
"""

import gc
import os

# Several test processes (pytest-xdist; CI runs two on two cores): each computes on one thread, and so do the servers
# and programs it starts (they inherit this). With the libraries' default of a thread per core, torch's OpenMP and
# numpy's OpenBLAS threads spin-wait while the other process computes: beside two busy processes a host-tier test took
# 69 s on two threads, 7.8 s on one. Set before torch or numpy is imported; an explicit setting is kept.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for threads in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(threads, "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():  # before anything imports triton (transformers does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.hf_checkpoints import CheckpointCache  # noqa: E402

SKIPPED_FOR_DEVICES = "needs {n} CUDA device(s), {have} here"


def pytest_collection_modifyitems(config, items):
    have = torch.cuda.device_count()
    for item in items:
        marker = item.get_closest_marker("gpus")
        if marker is None:
            continue
        item.add_marker(pytest.mark.gpu)
        n = marker.args[0] if marker.args else 1
        if have < n:
            item.add_marker(pytest.mark.skip(reason=SKIPPED_FOR_DEVICES.format(n=n, have=have)))


def pytest_runtest_logreport(report):
    """With PDSERVE_TESTS_INSTAFAIL=1 (benchmarks/gpu_run.sh tests), a failure's traceback is printed when it
    happens, not at the end: a device run cut short by its time limit still shows why each failed test failed."""
    if report.failed and os.environ.get("PDSERVE_TESTS_INSTAFAIL") == "1":
        print(f"\nFAILED {report.nodeid} ({report.when}):\n{report.longreprtext[-3000:]}\n", flush=True)


def pytest_terminal_summary(terminalreporter):
    """Name every test skipped for want of CUDA devices (on a one-GPU machine: the ones a larger kind must run)."""
    lines = []
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if "CUDA device(s)" in reason:
            lines.append(f"{report.nodeid}: {reason.removeprefix('Skipped: ')}")
    if lines:
        terminalreporter.write_line(f"{len(lines)} test(s) need more CUDA devices than this machine has:")
        for line in lines:
            terminalreporter.write_line(f"  {line}")


@pytest.fixture(autouse=True)
def free_gpu_memory():
    """An engine sizes its KV cache from the GPU's free memory: hand the next test what this one's engines held
    (they may sit in reference cycles, and torch's allocator keeps freed memory cached)."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> CheckpointCache:
    return CheckpointCache(tmp_path_factory)


@pytest.fixture(scope="session")
def llama(checkpoints):
    """A tiny random Llama checkpoint written by transformers (varied greedy output)."""
    return checkpoints.get("LlamaForCausalLM")


@pytest.fixture(scope="session")
def reference(llama):
    """The single engine on `llama`: what served outputs must equal."""
    from engine import LLM
    return LLM(str(llama))
