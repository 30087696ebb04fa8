"""engine.kernels.stage_inputs: a decode step's inputs staged into a graph's static buffers in one launch, against
the torch copies it replaced (on the CPU under Triton's interpreter; on CUDA, tests/test_cuda.py's graph and
overlapped-decode tests replay through it)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.stage_inputs import BLOCK_W, stage_decode_inputs

pytestmark = pytest.mark.gpu  # compiled on a CUDA device when there is one (tests/conftest.py)
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # on the CPU: the kernel under the interpreter


def _buffers(rows: int, width: int):
    # static buffers full of stale values, as a graph's are after earlier, larger steps
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    return [torch.randint(1, 1000, (rows,), generator=gen, dtype=torch.int32) for _ in range(4)] + [
        torch.randint(1, 1000, (rows, width), generator=gen, dtype=torch.int32)]


@pytest.mark.parametrize("rows,bucket,width", [(1, 1, 3), (5, 8, BLOCK_W + 7), (16, 16, 2 * BLOCK_W)])
@pytest.mark.parametrize("pending", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_staging_equals_the_torch_copies(rows, bucket, width, pending, device):
    gen = torch.Generator().manual_seed(rows)
    ids, pos, slots, lens = (torch.randint(0, 5000, (rows,), generator=gen, dtype=torch.int32) for _ in range(4))
    tables = torch.randint(0, 9000, (rows, width), generator=gen, dtype=torch.int32)
    prev = torch.randint(0, 128000, (rows + 3,), generator=gen, dtype=torch.int64)  # the step before's samples
    take = torch.tensor([(i * 7) % (rows + 3) if i % 2 == 0 else -1 for i in range(rows)], dtype=torch.int32)
    dst = _buffers(32, 2 * BLOCK_W + 5)
    expected = [t.clone() for t in dst]
    own = ids.clone()
    if pending:
        own = torch.where(take >= 0, prev[take.clamp(min=0).long()].to(torch.int32), ids)
    for buf, src in zip(expected[:4], (own, pos, slots, lens), strict=True):
        buf[:rows] = src
    expected[2][rows:bucket] = -1
    expected[3][rows:bucket] = 0
    expected[4][:rows, :width] = tables
    dev = torch.device(device)
    dst = [t.to(dev) for t in dst]
    ids, pos, slots, lens, tables, take, prev = (t.to(dev) for t in (ids, pos, slots, lens, tables, take, prev))
    stage_decode_inputs(ids, pos, slots, lens, tables, take if pending else None, prev if pending else None,
                        *dst, bucket)
    for got, want in zip(dst, expected, strict=True):
        assert torch.equal(got.cpu(), want)


def test_staging_refuses_what_does_not_fit():
    ids = torch.zeros(4, dtype=torch.int32)
    tables = torch.zeros(4, 3, dtype=torch.int32)
    dst = _buffers(8, 4)
    with pytest.raises(ValueError, match="bucket of 2"):
        stage_decode_inputs(ids, ids, ids, ids, tables, None, None, *dst, 2)
    with pytest.raises(ValueError, match="width 5"):
        stage_decode_inputs(ids, ids, ids, ids, torch.zeros(4, 5, dtype=torch.int32), None, None, *dst, 4)
    with pytest.raises(ValueError, match="come together"):
        stage_decode_inputs(ids, ids, ids, ids, tables, ids, None, *dst, 4)
    with pytest.raises(ValueError, match="positions"):
        stage_decode_inputs(ids, ids.long(), ids, ids, tables, None, None, *dst, 4)
