"""CudaIpcPeer.close(): the peer's cache is unmapped only after every copy queued on it has ended, and a launch after
close is refused (PeerLost) instead of running against an unmapped cache. The cache's IPC handle comes from a child
process, as from a peer worker on the same host (one GPU is enough). Needs CUDA."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from kvtransfer.errors import PeerLost
from tests.kvtransfer_helpers import SPEC, bits, random_cache

pytestmark = pytest.mark.gpus(1)
NUM_BLOCKS = 64


def _exporter(conn) -> None:
    from kvtransfer.backends.cuda_ipc import export
    from kvtransfer.cache import RegisteredCache

    cache = RegisteredCache(random_cache(SPEC, NUM_BLOCKS, seed=7).cuda(), SPEC)
    conn.send(cache.info(export(cache)))
    conn.recv()  # the owner keeps its cache until the test is done with the mapping


def test_close_waits_for_queued_copies_and_later_launches_are_refused():
    from kvtransfer.backends.cuda_ipc import CudaIpcPeer
    from kvtransfer.cache import RegisteredCache
    from kvtransfer.head_slices import plan_transfer

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_exporter, args=(child,), daemon=True)
    owner.start()
    try:
        assert parent.poll(120), "the exporting process sent no cache"
        remote_info = parent.recv()
        local = RegisteredCache(torch.zeros(SPEC.shape(NUM_BLOCKS), dtype=torch.bfloat16, device="cuda"), SPEC)
        peer = CudaIpcPeer(local, remote_info)
        src, dst = list(range(0, 32)), list(range(32, 64))
        chunks = plan_transfer("read", dst, src, None, None, local.info(), remote_info, "owner", 1 << 30)
        peer.launch("read", chunks, None).synchronize()  # the copy kernel compiled, so the launch below is quick
        local.kv.zero_()
        torch.cuda._sleep(1 << 32)  # ~2 s of GPU time on the caller's stream: the copies wait behind it
        ready = torch.cuda.Event()
        ready.record()
        done = peer.launch("read", chunks, ready)
        assert not done.query()  # still queued when close() begins
        peer.close()
        assert done.query()      # close() returned only after the copies ended
        expected = random_cache(SPEC, NUM_BLOCKS, seed=7)[src]
        assert torch.equal(bits(local.kv[dst].cpu()), bits(expected))
        with pytest.raises(PeerLost):
            peer.launch("read", chunks, None)
    finally:
        parent.send("done")
        owner.join(30)
