"""The stream between a decode worker and the coordinator: one TCP connection per worker, both ways. Outputs: the
worker's engine thread writes each step's deltas (`WorkerStream.send`), the coordinator reads them
(`StreamLink.batches`). Commands: the coordinator writes requests to start or abort (`StreamLink.send`), a thread of
the worker reads each and hands it to the worker's `on_command` at once.

Why not a Ray call per step, or per request: each call ran Ray's task machinery in the worker's process (argument
decoding, the coroutine's scheduling on the actor's event loop, the result's serialization) under the GIL, beside the
thread that steps the engine. Per step (the long-poll this replaces where the coordinator asks for it,
`DecodeWorker(..., stream=True)`) that was a quarter of the worker's GIL time on the 2-core machine; per
request, a `generate` took 11.4 ms from the coordinator's call to the worker's coroutine and ~1.4 ms of the worker's
CPU (docs/benchmark-log.md). Here a step's deltas are pickled and written by the engine thread itself, and a command
reaches the engine's queue from the reading thread with one unpickle.

Outputs: a batch is (deltas as StepDelta.wire tuples, the EngineLoad after the step, {request id: phase durations},
{request id: why a command for it failed}). Commands: tuples whose first item names them (decode_pool.decodes).
On the wire, both ways, a 4-byte little-endian length and the pickle. The worker listens on its node's address; the
coordinator connects, sends the worker's token (a secret it learnt with the worker's WorkerInfo, over Ray), then
both sides write. Batches sent before that connection, or between two, wait in a backlog, in order; commands exist
only on a live connection (the coordinator treats a broken one as the worker's death and moves its requests).
Ownership: the worker's threads (engine thread, event loop, command reader) send under one lock; only this module
touches the sockets. A write that fails or stalls for SEND_TIMEOUT_S closes the connection: the coordinator then
treats the worker as lost, as it did a failed poll.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import secrets
import socket
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 30.0
TOKEN_BYTES = 16
MAX_FRAME_BYTES = 1 << 30  # a longer announced frame is not ours: the reader stops
_LEN = 4

Batch = tuple[list[tuple], Any, dict, dict]  # (deltas, EngineLoad, phases, failed commands)


def _frame(obj: Any) -> bytes:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return len(payload).to_bytes(_LEN, "little") + payload


class WorkerStream:
    """The worker's end: a listener on `host` and, once the coordinator has connected, its connection, whose
    commands a reader thread hands to `on_command(command)` (on that thread, in order; None: commands ignored)."""

    def __init__(self, host: str, on_command: Callable[[tuple], None] | None = None) -> None:
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._on_command = on_command
        self._lock = threading.Lock()
        self._conn: socket.socket | None = None
        self._backlog: list[bytes] = []
        self._closed = False
        threading.Thread(target=self._accept_loop, name="worker-stream", daemon=True).start()

    def send(self, batch: Batch) -> None:
        """Send one batch (any thread; batches leave in the order of the calls)."""
        frame = _frame(batch)
        with self._lock:
            if self._conn is None:
                self._backlog.append(frame)
                return
            self._write(frame)

    def drop_backlog(self) -> None:
        """Forget the batches kept for a coordinator that is gone (its successor aborted their requests)."""
        with self._lock:
            if self._conn is None:
                self._backlog.clear()

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
            log.warning("stream to the coordinator closed: %s", why)
            try:
                self._conn.shutdown(socket.SHUT_RDWR)  # wakes its command reader
            except OSError:
                pass
            self._conn.close()
            self._conn = None

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.settimeout(SEND_TIMEOUT_S)
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
            threading.Thread(target=self._read_commands, args=(conn,), name="worker-stream-commands",
                             daemon=True).start()

    def _read_commands(self, conn: socket.socket) -> None:
        """One connection's commands, until it ends (the coordinator closed it, or it was replaced or dropped)."""
        try:
            while True:
                head = _recv_exactly(conn, _LEN, wait=True)
                n = int.from_bytes(head, "little")
                if n > MAX_FRAME_BYTES:
                    raise ValueError(f"a command of {n} bytes")
                command = pickle.loads(_recv_exactly(conn, n, wait=True))  # from the coordinator that knew our token
                if self._on_command is not None:
                    self._on_command(command)
        except (OSError, ConnectionError, ValueError, EOFError, pickle.UnpicklingError):
            pass  # the connection ended: the coordinator sees the same end
        except Exception:  # a command handler's bug must not pass silently, nor leave a live-looking stream
            log.exception("a command from the coordinator failed")
            with self._lock:
                if self._conn is conn:
                    self._drop("a command failed")


def _recv_exactly(conn: socket.socket, n: int, wait: bool = False) -> bytes:
    """n bytes; `wait`: through any number of the socket's timeouts (its timeout is there for the writes)."""
    data = bytearray()
    while len(data) < n:
        try:
            chunk = conn.recv(n - len(data))
        except TimeoutError:
            if wait:
                continue
            raise
        if not chunk:
            raise ConnectionError("the stream closed")
        data += chunk
    return bytes(data)


class StreamLink:
    """The coordinator's end of one worker's stream: `batches()` connects and yields the worker's batches until the
    stream ends (the worker's process died, or its stream broke; raises OSError/ConnectionError/ValueError on a
    broken or foreign stream); `send(command)` writes a command while connected."""

    def __init__(self, host: str, port: int, token: bytes) -> None:
        self._address = (host, port)
        self._token = token
        self._writer: asyncio.StreamWriter | None = None

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    def send(self, command: tuple) -> None:
        """Queue one command for the worker (it leaves in call order); ConnectionError when not connected."""
        if not self.connected:
            raise ConnectionError("the worker's stream is not connected")
        self._writer.write(_frame(command))

    async def batches(self) -> AsyncIterator[Batch]:
        reader, writer = await asyncio.open_connection(*self._address)
        try:
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            writer.write(self._token)
            await writer.drain()
            self._writer = writer
            while True:
                try:
                    head = await reader.readexactly(_LEN)
                except asyncio.IncompleteReadError as e:
                    if e.partial:
                        raise ConnectionError("the worker's stream ended inside a batch") from e
                    return
                n = int.from_bytes(head, "little")
                if n > MAX_FRAME_BYTES:
                    raise ValueError(f"the worker's stream announces a batch of {n} bytes")
                yield pickle.loads(await reader.readexactly(n))  # the cluster's own worker, reached through Ray
        finally:
            self._writer = None
            writer.close()
