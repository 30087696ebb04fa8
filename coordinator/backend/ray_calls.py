"""Fire-and-forget Ray calls: `quietly(ref)` awaits one only so that its failure is consumed, not logged as an
unretrieved error. For calls whose outcome nobody needs (an abort or release sent to a worker that may be dead):
a dead worker's requests are failed by the supervisor's path, not by these calls."""

from __future__ import annotations

import asyncio
from typing import Any

from ray.exceptions import RayActorError, RayTaskError


async def quietly(ref: Any) -> None:
    try:
        await ref
    except (RayActorError, RayTaskError, asyncio.CancelledError):
        pass


async def in_order(attempt: str, ends: list[Any]) -> None:
    """End an attempt on its workers one after the other (each call's failure ignored)."""
    for end in ends:
        await quietly(end.remote(attempt))
