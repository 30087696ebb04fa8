"""Link: the message channel between the core process and one HTTP frontend process (a Unix socket).

Owns framing and batching only. A message is any picklable tuple (both ends are pdserve processes of one server,
started by the same user, on one machine). `send()` queues a message; everything queued during one turn of the
event loop goes out as one frame (a 4-byte length, then one pickle of the list), so a decode step's outputs for many
streams cost one write and one unpickle, not one per stream. `batches()` yields the received frames' lists in order
and ends when the peer closes its end (or the connection breaks). Nothing here knows what the messages mean.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from collections.abc import AsyncIterator
from typing import Any

HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 1 << 30  # a frame larger than this is a broken peer, not a batch


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
