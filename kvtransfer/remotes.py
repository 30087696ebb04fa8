"""`Remote`: what an agent holds about one peer (metadata, data backend, UCX connection, CUDA IPC mapping) and
the transfers in flight with it; how it connects, and how it is dropped. `run_transfer`: the frame every
read/write runs in (in-flight bookkeeping, injected faults, failure accounting).

Used only from the owning agent's event-loop thread. A remote is *lost* once dropped (removed, replaced, or
dropped by fault injection): from then on every transfer with it fails with PeerLost and it never reconnects.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .agent_config import HandshakePolicy
from .backends.cuda_ipc import CudaIpcPeer
from .backends.ucx import UcxConnection
from .backends.ucx_handshake import with_retries
from .errors import PeerLost, TransferError, TransferTimeout
from .faults import Fault
from .metadata import AgentMetadata
from .metrics import TransferMetrics
from .notify_channel import NotifySender
from .step_times import StepTimes

DROP_WAIT_S = 5.0  # a dropped remote's cancelled transfers get this long to end (their UCX operations aborted)


@dataclass(eq=False)
class Remote:
    meta: AgentMetadata
    backend: str
    conn: UcxConnection | None = None
    ipc: CudaIpcPeer | None = None
    notifier: NotifySender | None = None  # our notification stream to it (where it listens for one)
    lost: str | None = None  # why it was dropped; None while usable
    dropped_by_fault: bool = False  # lost through fault injection (its failures count as injected)
    tasks: set[asyncio.Task] = field(default_factory=set)  # its transfers in flight
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def name(self) -> str:
        return self.meta.name

    def check(self) -> None:
        if self.lost is not None:
            raise PeerLost(f"remote {self.name!r} was {self.lost}")

    async def connect(self, hello: Callable[[], dict], deadline: float, policy: HandshakePolicy,
                      metrics: TransferMetrics, steps: StepTimes | None = None) -> UcxConnection:
        """The open connection, or a new one (introduced by `hello()`) if there is none or it broke (PeerLost once
        the remote is lost). A handshake that timed out or broke is tried again under `policy` before `deadline`;
        one refused (nothing listens: the peer is gone) fails at once with PeerLost; outcomes go to `metrics`, each
        attempt's steps to `steps` (None: not timed)."""
        async with self.lock:
            self.check()
            if self.conn is None or self.conn.broken is not None:
                m = self.meta
                conn = await with_retries(lambda d: UcxConnection.open(m, hello(), d, steps),
                                          policy, deadline, f"connect to {m.name!r}", metrics.record_handshake)
                if self.lost is not None:  # dropped while we were connecting: never keep that endpoint
                    conn.abort("remote dropped")
                    self.check()
                self.conn = conn
            return self.conn

    async def notify(self, agent_name: str, msg: bytes, deadline: float) -> None:
        """Send a notification on our stream to its listener (opened on first use); PeerLost once it is lost."""
        self.check()
        if self.notifier is None:
            m = self.meta
            assert m.notify_port is not None
            self.notifier = NotifySender(agent_name, m.address, m.notify_port, m.name)
        await self.notifier.send(msg, deadline)
        self.check()  # dropped while we were sending: what was sent may not be seen

    async def drop(self, reason: str, by_fault: bool = False) -> None:
        """Mark lost, abort the connection, cancel the transfers in flight (each then fails with PeerLost) and
        wait until they ended, then unmap the peer's cache. Returns once no transfer with it is running
        (bounded by DROP_WAIT_S; a transfer still running after that fails as soon as it wakes up)."""
        if self.lost is None:
            self.lost, self.dropped_by_fault = reason, by_fault
        if self.conn is not None:
            self.conn.abort(reason)
        if self.notifier is not None:
            self.notifier.close()
        me = asyncio.current_task()
        tasks = [t for t in self.tasks if t is not me]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=DROP_WAIT_S)
        if me not in self.tasks and self.ipc is not None:  # a transfer dropping its own remote leaves it mapped
            # close() waits for the copies queued on the mapping, also one launched from a caller's thread before
            # its task reached the loop (not in `tasks`); a GPU that never finishes them leaves it mapped, not hung
            ipc, self.ipc = self.ipc, None
            closing = asyncio.get_running_loop().run_in_executor(None, ipc.close)
            await asyncio.wait({closing}, timeout=DROP_WAIT_S)

    async def close(self) -> None:
        """Agent shutdown: close the connection gracefully (what was sent is delivered) and unmap."""
        if self.conn is not None:
            await self.conn.close()
        if self.notifier is not None:
            self.notifier.close()
        if self.ipc is not None:
            self.ipc.close()
            self.ipc = None


async def run_transfer(op: str, r: Remote, fault: Fault, deadline: float, work: Callable[[], Awaitable[None]],
                       metrics: TransferMetrics, in_flight: set[asyncio.Task], drop_reason: str) -> None:
    """Run one transfer with `r` on the loop: registered as in flight (with `r` and in the agent's `in_flight`)
    until it ended, its injected `fault` applied first, and its failure counted and surfaced as a TransferError
    (PeerLost once `r` is lost, whatever the transport saw)."""
    task = asyncio.current_task()
    assert task is not None
    r.tasks.add(task)
    in_flight.add(task)
    injected = False
    try:
        try:
            r.check()
            if fault.drop:
                injected = True
                await r.drop(drop_reason, by_fault=True)
                r.check()
            if fault.fail:
                injected = True
                metrics.record_injected("fail")
                raise TransferError(f"{op} with {r.name!r} failed: injected fault")
            if fault.stall_s > 0:
                metrics.record_injected("stall")
                remaining = deadline - time.monotonic()
                if fault.stall_s >= remaining:  # held past the deadline: ends as a real stall would
                    injected = True
                    await asyncio.sleep(max(0.0, remaining))
                    raise TransferTimeout(f"{op} with {r.name!r}: no progress before the deadline "
                                          f"(injected stall of {fault.stall_s} s)")
                await asyncio.sleep(fault.stall_s)
            await work()
        except asyncio.CancelledError:
            if r.lost is None:  # the agent is closing
                raise
            raise PeerLost(f"{op} with {r.name!r} failed: the remote was {r.lost}") from None
        except TransferError as e:
            if r.lost is not None and not isinstance(e, PeerLost):
                raise PeerLost(f"{op} with {r.name!r} failed: the remote was {r.lost} ({e})") from e
            raise
        except Exception as e:  # noqa: BLE001 - anything unexpected still surfaces as a TransferError
            raise TransferError(f"{op} with {r.name!r} failed: {e!r}") from e
    except TransferError as e:
        if isinstance(e, PeerLost) and r.dropped_by_fault:
            injected = True
            metrics.record_injected("drop")
        metrics.record_failure(op, e, injected)
        raise
    finally:
        r.tasks.discard(task)
        in_flight.discard(task)
