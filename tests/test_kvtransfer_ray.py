"""Two KVAgents in two Ray actors on loopback (real Ray, real ucxx, host memory): bit-exact scattered
reads and writes, partial layer ranges, notifications, and no staging left behind."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest

from tests.kvtransfer_helpers import SPEC, AgentActor, bits

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(180)

CONFIG = {"ucx_chunk_bytes": 4 * SPEC.block_bytes, "staging_bytes": 64 * SPEC.block_bytes}


@pytest.fixture(scope="module")
def actors() -> Iterator[tuple]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, old) if p)  # Ray workers inherit it
    owner = not ray.is_initialized()  # share a cluster another test module started; never shut it down
    if owner:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cls = ray.remote(num_cpus=0)(AgentActor)
    prefill = cls.remote("prefill", 48, 21, CONFIG)
    decode = cls.remote("decode", 40, 22, CONFIG)
    try:
        metas = ray.get([prefill.metadata.remote(), decode.metadata.remote()], timeout=120)
        ray.get([decode.add_remote.remote(metas[0]), prefill.add_remote.remote(metas[1])], timeout=60)
        yield prefill, decode
    finally:
        for a in (prefill, decode):
            try:
                ray.get(a.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        if owner:
            ray.shutdown()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _get(ref: object) -> object:
    return ray.get(ref, timeout=60)


def test_decode_pulls_scattered_blocks_bit_exact(actors) -> None:
    prefill, decode = actors
    rng = random.Random(5)
    for n in (1, 6, 11):
        src, dst = rng.sample(range(48), n), rng.sample(range(40), n)
        _get(decode.read.remote("prefill", src, dst, None, b"pulled"))
        assert bits(_get(decode.blocks.remote(dst))).equal(bits(_get(prefill.blocks.remote(src))))
    assert _get(prefill.notifications.remote(3, 20.0)) == {"decode": [b"pulled"] * 3}


def test_prefill_pushes_layer_ranges_bit_exact(actors) -> None:
    prefill, decode = actors
    src, dst = [3, 30, 17, 44, 8, 21, 9], [39, 0, 12, 25, 6, 7, 31]
    before = _get(decode.blocks.remote(dst))
    _get(prefill.write.remote("decode", src, dst, (0, 1)))
    _get(prefill.write.remote("decode", src, dst, (2, 4), b"req-1 ready"))
    now, want = _get(decode.blocks.remote(dst)), _get(prefill.blocks.remote(src))
    assert bits(now[:, 0:1]).equal(bits(want[:, 0:1]))
    assert bits(now[:, 2:4]).equal(bits(want[:, 2:4]))
    assert bits(now[:, 1]).equal(bits(before[:, 1]))  # layer 1 was not sent
    assert _get(decode.notifications.remote(1, 20.0)) == {"prefill": [b"req-1 ready"]}
    for a in (prefill, decode):
        assert _wait_clean(a)


def _wait_clean(actor: object) -> bool:
    import time

    end = time.monotonic() + 20
    while time.monotonic() < end:
        if _get(actor.metrics.remote())["staging_in_use"] == 0:  # type: ignore[attr-defined]
            return True
        time.sleep(0.05)
    return False
