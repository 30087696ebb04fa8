"""The stream a decode worker's outputs reach the coordinator on: one TCP connection per worker, written by the
worker's engine thread at the end of each step (`OutputStream.send`), read by the coordinator (`read_batches`).

Why not a Ray call per step (the long-poll it replaces where the coordinator asks for it, `DecodeWorker(...,
output_stream=True)`): each call ran Ray's task machinery in the worker's process (argument decoding, the
coroutine's scheduling, the result's serialization, the process title) under the GIL, beside the thread that
steps the engine; on the 2-core machine that was a quarter of the worker's GIL time (docs/benchmarks.md). Here a
step's deltas are pickled and written by the engine thread itself, the GIL released in the write.

A batch is (deltas as StepDelta.wire tuples, the EngineLoad after the step, {request id: phase durations}); on the
wire a 4-byte little-endian length and the pickle. The worker listens on its node's address; the coordinator
connects, sends the worker's token (a secret it learnt with the worker's WorkerInfo, over Ray) and reads. Batches
sent before that connection, or between two, wait in a backlog, in order. Ownership: the worker's threads (engine
thread, event loop) send under one lock; only this module touches the sockets. A write that fails or stalls for
SEND_TIMEOUT_S closes the connection: the coordinator then treats the worker as lost, as it did a failed poll.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import secrets
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 30.0
TOKEN_BYTES = 16
MAX_BATCH_BYTES = 1 << 30  # a longer announced batch is not ours: the reader stops
_LEN = 4

Batch = tuple[list[tuple], Any, dict]  # (deltas, EngineLoad, phases)


class OutputStream:
    """The worker's end: a listener on `host` and, once the coordinator has connected, its connection."""

    def __init__(self, host: str) -> None:
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._lock = threading.Lock()
        self._conn: socket.socket | None = None
        self._backlog: list[bytes] = []
        self._closed = False
        threading.Thread(target=self._accept_loop, name="output-stream", daemon=True).start()

    def send(self, batch: Batch) -> None:
        """Send one batch (any thread; batches leave in the order of the calls)."""
        payload = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        frame = len(payload).to_bytes(_LEN, "little") + payload
        with self._lock:
            if self._conn is None:
                self._backlog.append(frame)
                return
            self._write(frame)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop("closed")
            self._listener.close()

    def _write(self, frame: bytes) -> None:
        try:
            self._conn.sendall(frame)  # the GIL is released while the kernel takes it
        except OSError as e:  # a stall past SEND_TIMEOUT_S included: the reader sees the end and fails over
            self._drop(f"{type(e).__name__}: {e}")

    def _drop(self, why: str) -> None:
        if self._conn is not None:
            log.warning("output stream to the coordinator closed: %s", why)
            self._conn.close()
            self._conn = None

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                conn.settimeout(SEND_TIMEOUT_S)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if _recv_exactly(conn, TOKEN_BYTES) != self.token:
                    conn.close()
                    continue
            except OSError:
                conn.close()
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._drop("replaced by a new connection")
                self._conn = conn
                backlog, self._backlog = self._backlog, []
                for frame in backlog:
                    if self._conn is None:
                        self._backlog.append(frame)  # failed again: kept for the next connection
                    else:
                        self._write(frame)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed during the token")
        data += chunk
    return data


async def read_batches(host: str, port: int, token: bytes) -> AsyncIterator[Batch]:
    """The coordinator's end: connect to a worker's stream and yield its batches until it ends (the worker's
    process died, or its stream broke); raises OSError/ConnectionError/ValueError on a broken or foreign stream."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(token)
        await writer.drain()
        while True:
            try:
                head = await reader.readexactly(_LEN)
            except asyncio.IncompleteReadError as e:
                if e.partial:
                    raise ConnectionError("output stream ended inside a batch") from e
                return
            n = int.from_bytes(head, "little")
            if n > MAX_BATCH_BYTES:
                raise ValueError(f"output stream announces a batch of {n} bytes")
            yield pickle.loads(await reader.readexactly(n))  # the cluster's own worker, reached through Ray
    finally:
        writer.close()
