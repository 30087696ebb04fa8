"""The agent-to-agent protocol on top of tagged messages: message kinds, tags and their encoding.

Control messages are small JSON objects sent with `send_obj` (length-prefixed); bulk data is one tagged
message per chunk. Tags are integers (never str: Python's str hash differs between processes) that ucxx
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

from .errors import TransferError

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


def ok(**fields: object) -> dict:
    return {"ok": True, **fields}


def failure(err: BaseException) -> dict:
    kind = type(err).__name__ if isinstance(err, TransferError) else "RemoteError"
    return {"ok": False, "kind": kind, "error": str(err) or repr(err)}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)
