"""The transfer layer's exceptions: one class per way a transfer can fail, all under TransferError.

Every failure a caller can see is one of these, raised from `TransferHandle.wait()` / `await handle`
or from the agent call itself; the message names the peer and the operation.
"""

from __future__ import annotations


class TransferError(RuntimeError):
    """Base class: a transfer or a connection to a peer failed."""


class TransferTimeout(TransferError):
    """A transfer (or connect, or a wait for staging memory) did not finish within its timeout."""


class PeerLost(TransferError):
    """The remote agent died, closed its connection, or is unknown / removed."""


class IncompatibleLayout(TransferError):
    """The two caches disagree on model, dtype, block size, shape or layout version."""


class BadDescriptor(TransferError):
    """Block ids, layer range or counts that do not describe valid blocks of the registered caches."""


class RemoteError(TransferError):
    """The remote agent refused or failed the operation for a reason it reported (message included)."""


_BY_NAME: dict[str, type[TransferError]] = {
    cls.__name__: cls
    for cls in (TransferError, TransferTimeout, PeerLost, IncompatibleLayout, BadDescriptor, RemoteError)
}


def error_from_wire(kind: str, message: str) -> TransferError:
    """Rebuild an error the remote agent reported (kind = class name) as the matching local class."""
    return _BY_NAME.get(kind, RemoteError)(message)
