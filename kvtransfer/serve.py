"""The serving side of the protocol: what an agent does when a peer reads from or writes into its cache.

`Server` implements `backends.ucx_server.RequestHandler`. It owns nothing long-lived: each request borrows a slot
of the agent's *serve* staging pool (separate from the pool its own reads/writes use, so two agents
transferring to each other at once can never deadlock on staging) and returns it on every path. Failures
are replied to the peer (which raises them) and counted in the agent's metrics under "serve_read" /
"serve_write"; nothing raises on this side's caller, who has no call in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from . import wire
from .backends.ucx import BufferMayBeInUse
from .backends.ucx_server import PeerEndpoint
from .cache import RegisteredCache, event_done
from .descriptors import normalize_layers, region_bytes, validate_ids
from .errors import BadDescriptor, TransferError
from .inbox import Inbox
from .metadata import AgentMetadata, CacheInfo, check_compatible
from .metrics import TransferMetrics
from .staging import Slot, StagingPool


class Server:
    def __init__(
        self,
        get_cache: Callable[[], RegisteredCache | None],
        get_info: Callable[[], CacheInfo | None],
        get_pool: Callable[[], StagingPool | None],
        metrics: TransferMetrics,
        inbox: Inbox,
        name: str,
    ) -> None:
        self._get_cache = get_cache
        self._get_info = get_info
        self._get_pool = get_pool
        self._metrics = metrics
        self._inbox = inbox
        self._name = name  # the owning agent's, for error messages

    async def on_hello(self, peer: PeerEndpoint, msg: dict) -> dict:
        try:
            meta = AgentMetadata.from_bytes(wire.unb64(msg["meta"]))
            check_compatible(self._get_info(), meta, self._name)
        except (TransferError, KeyError) as e:
            self._metrics.record_failure("hello", e)
            return wire.failure(e)
        peer.peer = meta.name
        peer.meta = meta
        return wire.ok()

    def on_notify(self, peer: PeerEndpoint, msg: dict) -> None:
        """A notification: straight to the inbox (or its listener), from the peer's receive loop."""
        self._inbox.put(peer.peer, wire.unb64(msg["msg"]))

    async def on_request(self, peer: PeerEndpoint, msg: dict) -> None:
        op = msg.get("op")
        if op == "notify":
            self.on_notify(peer, msg)
        elif op in ("read", "write"):
            await self._serve(peer, msg, op)
        else:
            self._metrics.record_failure("serve", BadDescriptor(f"unknown op {op!r}"))

    def _target(self, msg: dict) -> tuple[RegisteredCache, tuple[int, ...], tuple[int, int], tuple[int, int] | None,
                                          int]:
        """(cache, block ids, layers, head slots or None for all, bytes) a request names, checked."""
        cache = self._get_cache()
        if cache is None:
            raise BadDescriptor("no KV cache is registered on this agent")
        layers = normalize_layers(msg.get("layers"), cache.spec.num_layers)
        ids = validate_ids(msg.get("ids", []), cache.num_blocks, "remote")
        if not ids:
            raise BadDescriptor("a transfer needs at least one block")
        heads = msg.get("heads")
        try:
            slots = cache.slots(None if heads is None else (int(heads[0]), int(heads[1])))
        except (ValueError, TypeError, IndexError) as e:
            raise BadDescriptor(f"heads {heads!r}: {e}") from e
        if slots is not None and msg.get("op") != "read":
            raise BadDescriptor("only reads move a part of a cache's heads")
        return cache, ids, layers, slots, region_bytes(len(ids), layers, cache.spec, slots)

    async def _serve(self, peer: PeerEndpoint, msg: dict, op: str) -> None:
        xid = int(msg.get("xid", 0))
        t0 = time.monotonic()
        deadline = t0 + float(msg.get("timeout", 30.0))
        slot: Slot | None = None
        pool: StagingPool | None = None
        replied = False
        unsafe = False
        try:
            cache, ids, layers, slots, nbytes = self._target(msg)
            if op == "write" and int(msg.get("nbytes", -1)) != nbytes:
                raise BadDescriptor(f"write announces {msg.get('nbytes')} bytes, blocks hold {nbytes}")
            buf = cache.region(ids, layers) if slots is None else None
            pool = self._get_pool()
            if buf is None and pool is not None:
                slot = await pool.acquire(nbytes, deadline)
                buf = slot.view
            if op == "read":
                if slot is not None:
                    cache.gather(ids, layers, buf, slots)
                    await event_done(cache.record(), deadline)
                await peer.reply(xid, wire.ok(nbytes=nbytes), deadline)
                replied = True
                await peer.send_data(buf, xid, deadline)
            else:
                await peer.reply(xid, wire.ok(), deadline)  # ready: the peer may send now
                replied = True
                await peer.recv_data(buf, xid, deadline)
                if slot is not None:
                    cache.scatter(ids, layers, buf)
                await event_done(cache.record(), deadline)
                if slot is not None and pool is not None:  # done with it before the peer hears "done"
                    pool.release(slot)
                    slot = None
                self._metrics.record_ok(f"serve_{op}", nbytes, time.monotonic() - t0)
                await peer.reply(xid, wire.ok(), deadline)
                return
            self._metrics.record_ok(f"serve_{op}", nbytes, time.monotonic() - t0)
        except BufferMayBeInUse as e:
            unsafe = True
            self._metrics.record_failure(f"serve_{op}", e)
        except Exception as e:  # noqa: BLE001 - every failure is replied, none kills the server
            if not isinstance(e, TransferError):
                e = TransferError(f"{op} failed on the serving side: {e!r}")
            self._metrics.record_failure(f"serve_{op}", e)
            if (op == "write" or not replied) and peer.broken is None:
                try:
                    await peer.reply(xid, wire.failure(e), min(deadline, time.monotonic() + 1.0))
                except TransferError:
                    pass
        finally:
            if slot is not None and pool is not None:
                (pool.quarantine if unsafe else pool.release)(slot)
