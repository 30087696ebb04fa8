"""The penalties kernel (engine/kernels/penalties.py) against the torch path it replaces on CUDA
(LogitsProcessing._penalise), bitwise: at a small vocabulary (on the CPU in Triton's interpreter, else on the GPU),
and at 128k entries, batch 64, where a GPU exists. Rows not penalised and entries past the vocabulary stay untouched."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.penalties import apply_penalties
from engine.sampling.logits_processing import LogitsProcessing, ProcessingBatch

pytestmark = pytest.mark.gpu  # runs its GPU path on a CUDA device when there is one (tests/conftest.py)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # the CPU runs Triton's interpreter (tests/conftest.py)


def _case(batch: int, vocab: int, slots: int, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen) * 4  # both signs, some exact zeros below
    logits[:, ::7] = 0.0
    counts = torch.randint(0, 4, (slots, vocab), generator=gen, dtype=torch.int32) * (
        torch.rand(slots, vocab, generator=gen) < 0.2)
    prompt = torch.rand(slots, vocab, generator=gen) < 0.1
    rows = torch.randperm(batch, generator=gen)[: batch - 1]  # one row without penalties
    chosen = torch.randperm(slots, generator=gen)[: rows.numel()]
    penalties = torch.stack([1 + torch.rand(rows.numel(), generator=gen),        # repetition in [1, 2)
                             torch.rand(rows.numel(), generator=gen) * 2 - 1,   # frequency in [-1, 1)
                             torch.rand(rows.numel(), generator=gen) * 2 - 1], dim=1)  # presence
    to = dict(device=device)
    return (logits.to(**to), rows.to(**to), chosen.to(**to), counts.to(**to), prompt.to(**to),
            penalties.to(**to))


def _torch_path(logits, rows, slots, counts, prompt, penalties) -> torch.Tensor:
    processing = LogitsProcessing(logits.device, [], None)
    processing._counts, processing._prompt = counts, prompt
    batch = ProcessingBatch(None, None, None, rows, slots, penalties, [])
    out = logits.clone()
    processing._penalise(batch, out)
    return out


@pytest.mark.parametrize("vocab", [300, 2048 + 5])  # one partial block; several blocks and a ragged end
def test_the_kernel_is_bitwise_the_torch_path(vocab):
    logits, rows, slots, counts, prompt, penalties = _case(5, vocab, 9, DEVICE, vocab)
    want = _torch_path(logits, rows, slots, counts, prompt, penalties)
    out = apply_penalties(logits.clone(), rows, slots, counts, prompt, penalties)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    assert not torch.equal(out, logits)  # it did something


def test_bad_arguments_are_refused_naming_them():
    logits, rows, slots, counts, prompt, penalties = _case(3, 64, 4, "cpu", 0)
    with pytest.raises(ValueError, match="counts must be one of"):
        apply_penalties(logits, rows, slots, counts.long(), prompt, penalties)
    with pytest.raises(ValueError, match="penalties a contiguous"):
        apply_penalties(logits, rows, slots, counts, prompt, penalties[:, :2])
    with pytest.raises(ValueError, match="counts and prompt must be"):
        apply_penalties(logits, rows, slots, counts[:, :32], prompt[:, :32], penalties)


@pytest.mark.skipif(not CUDA, reason="the real size needs a CUDA device")
def test_the_kernel_is_bitwise_the_torch_path_at_128k_on_cuda():
    args = _case(64, 128256, 96, "cuda", 1)
    want = _torch_path(*args)
    out = apply_penalties(args[0].clone(), *args[1:])
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
