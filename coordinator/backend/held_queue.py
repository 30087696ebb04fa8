"""HeldQueue: one request attempt's step outputs on their way from the decode poll to its reader, held back until a
chunk's worth of tokens is in.

A reader that streams `interval` tokens a chunk (ServerSettings.stream_interval, or its tenant's) gains nothing from
waking at every decode step: each wake-up costs the coordinator's event loop the whole per-delta path (the backend's
generators, the lifecycle, the detokenizer) for one token. So outputs wait here until `interval` tokens are held,
and then go to the reader together (it coalesces what is queued: coordinator.backend.output_intake.coalesced).
Never held: an attempt's first output (a collocated request's first token, so TTFT is untouched; in disaggregated
mode its first decode output, which also marks the request's join for its phases and bookings), one that ends the
request, and an error (which comes after the tokens held before it). A stop string is thus seen up to n - 1 tokens
late: the worker may decode that many more, which are not sent. Owned by the attempt that created it; the poll loop
and failures only put into it.
"""

from __future__ import annotations

import asyncio
from typing import Any


class HeldQueue(asyncio.Queue):
    def __init__(self, interval: int) -> None:
        super().__init__()
        self._interval = interval
        self._held: list[Any] = []  # StepOutputs not yet released, in order
        self._tokens = 0            # the tokens they carry
        self._released_any = False

    def put_nowait(self, item: Any) -> None:
        """Queue a StepOutput (held while it and those before it carry fewer than `interval` tokens) or the
        exception that ends the attempt (released at once, after what is held)."""
        ends = isinstance(item, BaseException) or item.finish_reason is not None
        if not ends:
            self._held.append(item)
            self._tokens += len(item.new_token_ids)
            if self._released_any and self._tokens < self._interval:
                return
        self._released_any = True
        for held in self._held:
            super().put_nowait(held)
        self._held.clear()
        self._tokens = 0
        if ends:
            super().put_nowait(item)
