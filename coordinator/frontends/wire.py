"""What crosses a Link besides plain data: errors and phase traces, as tuples both processes rebuild.

Exceptions are not pickled as they are: Overloaded's (and Unavailable's) retry-after and APIError's status, type
and headers live in attributes that pickle would drop. A trace travels as its state (start, seconds per phase,
cursor): both processes read one clock (time.monotonic is system-wide on a host), so the receiving side simply
takes the state over.
"""

from __future__ import annotations

from typing import Any

from coordinator import errors
from coordinator.contract import (
    BackendError,
    Overloaded,
    PrefillFailed,
    RequestTooLarge,
    TransferFailed,
    Unavailable,
    WorkerLost,
)
from coordinator.observability.phases import PhaseTrace, TraceState

_BACKEND_ERRORS = {cls.__name__: cls for cls in (BackendError, RequestTooLarge, WorkerLost, TransferFailed,
                                                  PrefillFailed)}
ErrorTuple = tuple[Any, ...]


def encode_error(e: BaseException) -> ErrorTuple:
    """An exception as a tuple decode_error() rebuilds; anything unexpected becomes a BackendError naming its type."""
    if isinstance(e, errors.APIError):
        return ("APIError", e.status, e.message, e.type, e.kind, e.param, e.code, dict(e.headers))
    if isinstance(e, Overloaded):
        return (type(e).__name__ if isinstance(e, Unavailable) else "Overloaded", str(e), e.retry_after_s)
    if isinstance(e, ValueError):  # a caller's bad argument (an admin call's rank): the HTTP side makes it a 400
        return ("ValueError", str(e))
    if type(e).__name__ in _BACKEND_ERRORS and isinstance(e, BackendError):
        return (type(e).__name__, str(e))
    return ("BackendError", "internal error in the core process (logged there under the request's id)")


def decode_error(t: ErrorTuple) -> Exception:
    kind = t[0]
    if kind == "APIError":
        status, message, type_, err_kind, param, code, headers = t[1:]
        return errors.APIError(status, message, type_, err_kind, param, code, headers)
    if kind in ("Overloaded", "Unavailable"):
        return (Unavailable if kind == "Unavailable" else Overloaded)(t[1], retry_after_s=t[2])
    if kind == "ValueError":
        return ValueError(t[1])
    return _BACKEND_ERRORS.get(kind, BackendError)(t[1])


def trace_state(trace: PhaseTrace | None) -> TraceState | None:
    return None if trace is None else trace.state()


def trace_from(state: TraceState | None) -> PhaseTrace | None:
    return None if state is None else PhaseTrace.restored(state)
