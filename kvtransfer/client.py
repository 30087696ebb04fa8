"""The initiating side of a UCX transfer: move one chunk between our cache and a peer's, as one message.

read:  request -> peer gathers -> one message -> we receive into our cache (a contiguous region) or a
       staging slot, then scatter.
write: we gather into a staging slot (or send a contiguous region as is) -> request -> "ready" -> one
       message -> peer scatters -> "done".
A head-sliced read (chunk.heads) asks the peer for those global heads only, and receives them into the cache
if they are all of its heads and the blocks are one region, else into a slot scattered into its head slots.
The slot comes from the agent's client pool and goes back on every path (or is quarantined when a
cancelled receive might still write into it).
"""

from __future__ import annotations

import time

from .backends.ucx import BufferMayBeInUse, UcxConnection
from .cache import RegisteredCache, event_done
from .descriptors import Chunk
from .staging import Slot, StagingPool


async def ucx_chunk(
    op: str, conn: UcxConnection, cache: RegisteredCache, pool: StagingPool, chunk: Chunk, xid: int,
    deadline: float,
) -> int:
    """Move one chunk (`op` = "read": peer -> us, "write": us -> peer); returns its byte count."""
    nbytes = chunk.nbytes(cache.spec)
    request = {
        "op": op, "xid": xid, "ids": list(chunk.remote_ids), "layers": list(chunk.layers), "nbytes": nbytes,
    }
    if chunk.heads is not None:
        request["heads"] = list(chunk.heads)
    slots = cache.slots(chunk.heads)
    slot: Slot | None = None
    unsafe = False
    buf = cache.region(chunk.local_ids, chunk.layers) if slots is None else None
    try:
        if buf is None:
            slot = await pool.acquire(nbytes, deadline)
            buf = slot.view
        request["timeout"] = max(0.0, deadline - time.monotonic())
        if op == "read":
            await conn.request(request, xid, deadline)
            await conn.recv_data(buf, xid, deadline)
            if slot is not None:
                cache.scatter(chunk.local_ids, chunk.layers, buf, slots)
            await event_done(cache.record(), deadline)
        else:
            if slot is not None:
                cache.gather(chunk.local_ids, chunk.layers, buf, slots)
            await event_done(cache.record(), deadline)
            await conn.request(request, xid, deadline)  # "ready"
            await conn.send_data(buf, xid, deadline)
            await conn.response(xid, deadline)  # "done": the peer's blocks hold the data
        return nbytes
    except BufferMayBeInUse:
        unsafe = True
        raise
    finally:
        if slot is not None:
            (pool.quarantine if unsafe else pool.release)(slot)
