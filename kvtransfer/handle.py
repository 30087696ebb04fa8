"""`TransferHandle`: what a read or write returns at once, to poll, wait on with a timeout, or await.

The transfer itself runs on the agent's event-loop thread; the handle wraps its concurrent Future, so any
thread (the engine's step loop included) can check it without blocking, and asyncio code can `await` it.
A cuda_ipc transfer without a notification is finished when its GPU copy is: its handle also holds that CUDA
event, and poll()/wait() look at the event directly (no hop through the loop thread; the loop still completes
the future and the metrics).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import time
from collections.abc import Generator
from typing import Any

from .errors import TransferError, TransferTimeout


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferHandle:
    """One read or write. `nbytes` is the payload size; the result of a finished transfer is None."""

    SPIN_S = 0.005  # wait() spins on a GPU event this long, then leaves long waits to the loop thread

    def __init__(self, future: concurrent.futures.Future, op: str, remote: str, nbytes: int,
                 gpu_done: Any = None) -> None:
        self._future = future
        self.op = op
        self.remote = remote
        self.nbytes = nbytes
        self._gpu_done = gpu_done  # torch.cuda.Event whose completion is the transfer's, or None

    @property
    def future(self) -> concurrent.futures.Future:
        """The underlying future (completes on the agent's loop thread)."""
        return self._future

    @property
    def gpu_done(self) -> Any:
        """The torch.cuda.Event whose completion is the transfer's (a cuda_ipc read or write without a
        notification), or None."""
        return self._gpu_done

    def poll(self) -> TransferState:
        """PENDING, DONE or FAILED; never blocks."""
        if not self._future.done():
            return TransferState.DONE if self._gpu_finished() else TransferState.PENDING
        return TransferState.FAILED if self._future.exception() is not None else TransferState.DONE

    def done(self) -> bool:
        return self._future.done() or self._gpu_finished()

    def _gpu_finished(self) -> bool:
        return self._gpu_done is not None and self._gpu_done.query()

    def error(self) -> BaseException | None:
        """The failure of a finished transfer, or None (also while pending)."""
        return self._future.exception() if self._future.done() else None

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; raise its TransferError, or TransferTimeout if still pending after `timeout` s.

        A wait that times out does not cancel the transfer: it still ends by its own deadline.
        """
        if self._gpu_done is not None and not self._future.done():
            spin_until = time.monotonic() + min(self.SPIN_S, timeout if timeout is not None else self.SPIN_S)
            while time.monotonic() < spin_until:
                if self._gpu_done.query():
                    return
            if timeout is not None:
                timeout = max(0.0, timeout - self.SPIN_S)
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError as e:
            if self._future.done():  # the transfer itself raised a builtin TimeoutError
                raise TransferTimeout(str(e)) from e
            raise TransferTimeout(f"{self.op} with {self.remote!r} still pending after {timeout} s") from e
        except TransferError:
            raise
        except Exception as e:  # anything unexpected still surfaces as a TransferError
            raise TransferError(f"{self.op} with {self.remote!r} failed: {e!r}") from e

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.wrap_future(self._future).__await__()

    def __repr__(self) -> str:
        return f"TransferHandle({self.op} {self.remote!r}, {self.nbytes} B, {self.poll().value})"
