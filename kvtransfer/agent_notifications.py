"""AgentNotifications: KVAgent's small messages between agents, a mixin (kvtransfer.agent builds the state it reads).

A notification (at most wire.MAX_NOTIFY_BYTES) goes over the peer's TCP notification stream where it has one
(kvtransfer.notify_channel), else as a UCX request; it arrives after every transfer to that peer that finished
before it. Received ones are queued in the agent's inbox or passed to a listener on the loop thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from . import wire
from .cache import event_done
from .errors import TransferError
from .handle import TransferHandle
from .remotes import Remote

NOTIFY_SPIN_S = 0.005  # notify_after polls the copies' events this long on the loop before a thread waits for them


class AgentNotifications:
    def notify(self, remote: str, msg: bytes, timeout: float | None = None) -> TransferHandle:
        """Send a small message (at most wire.MAX_NOTIFY_BYTES); it arrives after every transfer to `remote` that
        finished before. One way: the handle succeeds once the message is sent, and fails if the send failed."""
        r = self._refused("notify", lambda: self._notify_check(remote, msg))
        deadline = time.monotonic() + (timeout or self.config.timeout_s)
        fut = self._loop.submit(self._notify(r, bytes(msg), deadline))
        return TransferHandle(fut, "notify", remote, len(msg))

    def notify_after(self, remote: str, msg: bytes, handles: Sequence[TransferHandle],
                     timeout: float | None = None) -> TransferHandle:
        """Send `msg` once all `handles` succeeded (without blocking the caller; a cuda_ipc copy counts once its
        event has completed, polled on the agent's loop); if one fails, the message is not sent and this handle
        fails with that error."""
        r = self._refused("notify", lambda: self._notify_check(remote, msg))
        deadline = time.monotonic() + (timeout or self.config.timeout_s)

        async def run() -> None:
            for h in handles:
                if h.gpu_done is not None:  # a cuda_ipc copy: its event's end is the data's landing
                    try:
                        await event_done(h.gpu_done, deadline, spin_s=NOTIFY_SPIN_S)
                        continue
                    except TransferError:
                        pass  # the handle's own outcome decides
                await asyncio.wrap_future(h.future)
            await self._notify(r, bytes(msg), deadline)

        return TransferHandle(self._loop.submit(run()), "notify", remote, len(msg))

    def on_notification(self, listener: Callable[[str, bytes], None] | None) -> None:
        """Have every notification from now on passed to listener(sender, msg) on the agent's loop thread (which
        it must not block) instead of queued for get_notifications; None queues them again."""
        self._inbox.listener = listener

    def get_notifications(self) -> dict[str, list[bytes]]:
        """Drain received notifications: {sender agent name: [msg, ...]} in arrival order."""
        return self._inbox.drain()

    def wait_notifications(self, timeout: float) -> dict[str, list[bytes]]:
        """Like get_notifications, but first wait up to `timeout` s for at least one."""
        self._inbox.wait(timeout)
        return self._inbox.drain()

    def _notify_check(self, remote: str, msg: bytes | None) -> Remote:
        if msg is not None:
            wire.check_notify(msg)
        return self._remote(remote)

    async def _send_notify(self, r: Remote, msg: bytes, deadline: float) -> None:
        if r.meta.notify_port is not None:  # its TCP notification stream (kvtransfer.notify_channel): far quicker
            await r.notify(self.name, msg, deadline)
            return
        conn = await self._connect(r, deadline)
        await conn.send_request({"op": "notify", "msg": wire.b64(msg)}, deadline)

    async def _notify(self, r: Remote, msg: bytes, deadline: float) -> None:
        """A notification on its own, its failure counted under "notify"."""
        try:
            await self._send_notify(r, msg, deadline)
        except TransferError as e:
            self._metrics.record_failure("notify", e)
            raise
        except Exception as e:  # noqa: BLE001
            self._metrics.record_failure("notify", e)
            raise TransferError(f"notify to {r.name!r} failed: {e!r}") from e
