"""Link: the message channel between the core process and one HTTP frontend process (a Unix socket).

Owns framing and batching only. A message is any picklable tuple (both ends are pdserve processes of one server,
started by the same user, on one machine). `send()` queues a message; everything queued during one turn of the
event loop goes out as one frame (a 4-byte length, then one pickle of the list), so a decode step's outputs for many
streams cost one write and one unpickle, not one per stream. `batches()` yields the received frames' lists in order
and ends when the peer closes its end (or the connection breaks). A peer that stops reading while this end keeps
sending (a wedged HTTP process: its streams' tokens would pile up in this process's memory) is cut off once
MAX_BUFFERED_BYTES wait unsent: the link aborts, so both ends see it end (the core then cancels that process's
streams, and the process exits and is replaced). Nothing here knows what the messages mean.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import struct
from collections.abc import AsyncIterator
from typing import Any

HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 1 << 30  # a frame larger than this is a broken peer, not a batch
MAX_BUFFERED_BYTES = 256 << 20  # unsent bytes beyond this: the peer has stopped reading
log = logging.getLogger("pdserve")


class LinkClosed(ConnectionError):
    """The other process's end of the link is gone."""


class Link:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._outbox: list[Any] = []
        self._closed = False

    @classmethod
    async def connect(cls, path: str) -> Link:
        reader, writer = await asyncio.open_unix_connection(path, limit=MAX_FRAME_BYTES)
        return cls(reader, writer)

    @property
    def closed(self) -> bool:
        return self._closed or self._writer.is_closing()

    def send(self, message: Any) -> None:
        """Queue `message`; it leaves with the others of this loop turn. Raises LinkClosed once the link is closed."""
        if self.closed:
            raise LinkClosed("the link is closed")
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(message)

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        if batch and not self.closed:
            body = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
            self._writer.write(HEADER.pack(len(body)) + body)
            unsent = self._writer.transport.get_write_buffer_size()
            if unsent > MAX_BUFFERED_BYTES:
                log.error("a link's peer has stopped reading (%d bytes unsent): cutting it off", unsent)
                self._writer.transport.abort()
                self._closed = True

    async def batches(self) -> AsyncIterator[list[Any]]:
        """Each received frame's messages, in order, until the peer closes the link."""
        try:
            while True:
                head = await self._reader.readexactly(HEADER.size)
                (size,) = HEADER.unpack(head)
                if size > MAX_FRAME_BYTES:
                    raise LinkClosed(f"a frame of {size} bytes: the peer is broken")
                yield pickle.loads(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            self._closed = True

    def close(self) -> None:
        if not self._writer.is_closing():
            self._flush()
            self._writer.close()
        self._closed = True
