"""The agent-to-agent protocol on top of tagged messages: message kinds, tags and their encoding.

Control messages are JSON objects, each one *frame*: one tagged message of at most FRAME_BYTES, an 8-byte
little-endian body length then the body, received into a buffer of FRAME_BYTES (UCX delivers a shorter message
whole; ucxx's recv tells no length, hence the prefix). A body too long for a frame goes as a frame holding only its
length, then the body as a second message on the same tag. A body is at most MAX_BODY_BYTES (a notification's
message at most MAX_NOTIFY_BYTES, base64 inside the JSON). (ucxx's send_obj always sends two messages, and the
second only once the first completed: a small message's latency doubled.) Bulk data is one tagged message per
chunk. Tags are integers (never str: Python's str hash differs between processes) that ucxx
hashes together with the endpoint's own tag, so concurrent operations on one connection never cross:

  REQUEST_TAG            client -> server: {"op": "hello" | "read" | "write" | "notify", ...}
  response_tag(xid)      server -> client: {"ok": true, ...} | {"ok": false, "kind": ErrorClass, "error": msg}
  data_tag(xid)          the chunk's bytes, either direction

read:   client REQUEST{op=read, xid, ids, layers, timeout} -> server RESPONSE{ok} + DATA
write:  client REQUEST{op=write, xid, ids, layers, nbytes, timeout} -> server RESPONSE{ok} (slot ready)
        -> client DATA -> server RESPONSE{ok} (scattered)
notify: client REQUEST{op=notify, msg} (one way; ordered after the transfers that preceded it)
hello:  client REQUEST{op=hello, meta} -> server RESPONSE{ok} | {ok: false, kind: IncompatibleLayout}
"""

from __future__ import annotations

import base64
import json
from typing import Any

from .errors import BadDescriptor, TransferError

Endpoint = Any  # a ucxx Endpoint (not imported here: no ucxx needed to speak about the protocol)

FRAME_BYTES = 16 << 10
MAX_BODY_BYTES = 64 << 20
MAX_NOTIFY_BYTES = 32 << 20
_LEN = 8  # the length prefix
REQUEST_TAG = 1
_RESPONSE = 2 << 48
_DATA = 3 << 48


def response_tag(xid: int) -> int:
    return _RESPONSE | xid


def data_tag(xid: int) -> int:
    return _DATA | xid


def encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def decode(raw: object) -> dict:
    return json.loads(bytes(raw))  # type: ignore[arg-type]


def frame(msg: dict) -> tuple[bytes, bytes | None]:
    """`msg` as (the frame, the body to send after it or None if the frame holds it)."""
    body = encode(msg)
    if len(body) > MAX_BODY_BYTES:
        raise BadDescriptor(f"a {msg.get('op', 'reply')} message of {len(body)} bytes exceeds the limit of "
                            f"{MAX_BODY_BYTES} bytes (kvtransfer.wire.MAX_BODY_BYTES)")
    head = len(body).to_bytes(_LEN, "little")
    if inline(len(body)):
        return head + body, None
    return head, body


def inline(nbytes: int) -> bool:
    """Whether a body of `nbytes` travels inside its frame."""
    return nbytes <= FRAME_BYTES - _LEN


def body_length(buf: bytearray) -> int:
    """The body length a received frame announces (ValueError if over MAX_BODY_BYTES: not our protocol)."""
    n = int.from_bytes(buf[:_LEN], "little")
    if n > MAX_BODY_BYTES:
        raise ValueError(f"a frame announces {n} bytes, over the limit of {MAX_BODY_BYTES}")
    return n


def check_notify(msg: bytes) -> None:
    """Refuse a notification message over MAX_NOTIFY_BYTES (BadDescriptor naming the limit)."""
    if len(msg) > MAX_NOTIFY_BYTES:
        raise BadDescriptor(f"a notification of {len(msg)} bytes exceeds the limit of {MAX_NOTIFY_BYTES} bytes "
                            "(kvtransfer.wire.MAX_NOTIFY_BYTES)")


def decode_frame(buf: bytearray, nbytes: int) -> dict:
    """The message inside a received frame holding an inline body of `nbytes`."""
    return json.loads(bytes(buf[_LEN:_LEN + nbytes]))


async def send_msg(ep: Endpoint, msg: dict, tag: int) -> None:
    """Send a control message on `ep` (a ucxx Endpoint) as one frame, its body after it if too long for one."""
    first, rest = frame(msg)
    await ep.send(first, tag=tag)
    if rest is not None:
        await ep.send(rest, tag=tag)


async def recv_msg(ep: Endpoint, tag: int, buf: bytearray | None = None) -> dict:
    """Receive a control message sent by `send_msg`; `buf`: a FRAME_BYTES buffer to reuse (None: a new one)."""
    if buf is None:
        buf = bytearray(FRAME_BYTES)
    await ep.recv(buf, tag=tag)
    nbytes = body_length(buf)
    if inline(nbytes):
        return decode_frame(buf, nbytes)
    body = bytearray(nbytes)
    await ep.recv(body, tag=tag)
    return decode(body)


def ok(**fields: object) -> dict:
    return {"ok": True, **fields}


def failure(err: BaseException) -> dict:
    kind = type(err).__name__ if isinstance(err, TransferError) else "RemoteError"
    return {"ok": False, "kind": kind, "error": str(err) or repr(err)}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)
