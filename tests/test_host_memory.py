"""engine.runner.host_memory: with keep_freed_memory(), a prefill-shaped loop of large activations re-uses heap
pages instead of faulting in new mappings; each case in a fresh process (the setting is process-wide)."""

import subprocess
import sys

import pytest

LOOP = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from engine.runner.host_memory import keep_freed_memory
    assert keep_freed_memory()
torch.set_num_threads(1)
x = torch.randn(1536, 256)
w, w2 = torch.randn(1376, 256), torch.randn(256, 688)
def step():  # tiny's MLP over a 1,536-token prefill step, four layers: activations of 4-8 MiB
    h = x
    for _ in range(4):
        y = torch.nn.functional.linear(h, w)
        h = torch.nn.functional.linear(torch.nn.functional.silu(y[:, :688]) * y[:, 688:], w2) + h
for _ in range(5):  # the heap grows to the loop's peak first
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", LOOP, mode], capture_output=True, text=True, check=True, timeout=120)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_activations_reuse_the_heap_instead_of_new_pages():
    default, kept = _faults("default"), _faults("keep")
    assert default > 10 * 1024  # glibc unmapped and re-mapped them: thousands of 4 KiB pages a step
    assert kept < default / 4
