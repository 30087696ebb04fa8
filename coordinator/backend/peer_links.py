"""Which workers' transfer agents connect to which: the one rule that Pools' start, connect and disconnect share;
and `connect_link`, which makes one such connection, trying again after a timeout.

A link (a, b) means worker a's agent adds b's (a.add_peer(b)): a reads KV from b's blocks or writes into them.
- disaggregated: every decode worker to every prefill worker (decode pulls the prompt's KV); with pushes, every
  prefill worker to every decode worker too (prefill writes into decode's blocks); with prefix fetching
  (Pools.prefills_connect), every prefill worker to every other (a prefill fetches a prefix another holds);
- adaptive: every worker to every other (any may hand KV to any);
- collocated: none.
A worker's role here is the one it started with (info.role): a role flip in adaptive mode keeps its links.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvtransfer.errors import PeerLost, TransferTimeout

CONNECT_ATTEMPTS = 4  # a transfer connection that times out (a loaded machine, a slow network) is tried again
CONNECT_BACKOFF_S = 1.0  # ... after this wait, doubled each time: a peer too busy to answer gets time to catch up
RETRIED = (PeerLost, TransferTimeout)

log = logging.getLogger(__name__)


class Linked(Protocol):
    name: str
    info: object  # WorkerInfo: .role


def peer_links(workers: Sequence[Linked], mode: str, pushes: bool, prefills_connect: bool
               ) -> list[tuple[Linked, Linked]]:
    """Every link (a, b) among `workers` (module docstring), in start order: for a pair linked both ways, (a, b)
    comes first where a is the decode side (disaggregated) or the earlier worker (adaptive, prefill to prefill)."""
    if mode == "collocated":
        return []
    if mode == "adaptive":
        return [(a, b) for a in workers for b in workers if a is not b]
    prefill = [w for w in workers if w.info.role == "prefill"]
    decode = [w for w in workers if w.info.role != "prefill"]
    links = [(d, p) for d in decode for p in prefill]
    if pushes:
        links += [(p, d) for d in decode for p in prefill]
    if prefills_connect:
        links += [(a, b) for a in prefill for b in prefill if a is not b]
    return links


def waves(links: list[tuple[Linked, Linked]]) -> tuple[list, list]:
    """`links` split in two waves, so that no pair connects both ways at once: a link whose reverse comes later
    in `links` goes in the first wave, its reverse in the second."""
    first, second, seen = [], [], set()
    for a, b in links:
        if (b.name, a.name) in seen:
            second.append((a, b))
        else:
            first.append((a, b))
            seen.add((a.name, b.name))
    return first, second


async def connect_link(call: Callable[[], Any], what: str) -> None:
    """Run a peer-connecting actor call (add_peer / replace_peer: a failed connect registers nothing, so it may
    be repeated), again after a PeerLost or TransferTimeout, up to CONNECT_ATTEMPTS times, waiting
    CONNECT_BACKOFF_S (doubled each time) in between."""
    wait = CONNECT_BACKOFF_S
    for attempt in range(1, CONNECT_ATTEMPTS + 1):
        try:
            await call()
            return
        except Exception as e:  # noqa: BLE001 - Ray wraps the worker's PeerLost; anything else is raised as is
            if attempt == CONNECT_ATTEMPTS or not (isinstance(e, RETRIED) or isinstance(getattr(e, "cause", None),
                                                                                      RETRIED)):
                raise
            log.warning("connecting %s failed (attempt %d of %d), trying again in %.0f s: %s", what, attempt,
                        CONNECT_ATTEMPTS, wait, e)
            await asyncio.sleep(wait)
            wait *= 2
