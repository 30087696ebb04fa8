"""A load sent from several OS processes, and what sending it cost this machine's CPUs.

One asyncio process parsing server-sent events spends ~50-120 us of CPU a chunk (httpx; 2-core machine, one event a
read): near 12,000 chunks/s it is busy all the time, chunks wait in its socket buffers and the gaps it records are
its own (two chunks "arriving" together: benchmarks/client_ceiling.py). A served 8B model on one H200 streams 11,000
chunks/s. So a load may be split over `count` processes, each sending a `Share` of it (every count-th request,
conversation or closed-loop lane) from one common start instant, and every process reports its CPU seconds per
second of the run (`ClientUsage`), so a report can say when its client, not the server, set the pace.

Owns `Share`, `ClientUsage` and `fan_out`, which runs an async function once per share in spawned processes and
returns what each returned. The function must be a module-level one (the processes are spawned, not forked: a
fork of a process with threads and an event loop is unsafe) and its arguments picklable. A process that fails or
dies is an error naming it, never a hang: fan_out waits for each at most its `timeout_s`.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CLIENT_BUSY = 0.85   # CPU seconds per second above which a client process is taken to pace what it measures
READY_TIMEOUT_S = 120.0  # for a spawned process to import its modules and report ready
START_MARGIN_S = 0.1  # between every process being ready and the common start


@dataclass(frozen=True)
class Share:
    """Which part of a load one process sends: `index` of `count` (0 <= index < count)."""
    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"a share's index must be in [0, {self.count}), got {self.index}")

    def mine(self, i: int) -> bool:
        """Whether the load's i-th item (request, conversation, lane) is this share's."""
        return i % self.count == self.index

    def of(self, total: int) -> int:
        """This share's part of `total` items dealt round-robin."""
        return total // self.count + (self.index < total % self.count)


@dataclass(frozen=True)
class ClientUsage:
    """CPU seconds per second of wall time, one figure per client process."""
    cpu_s_per_s: tuple[float, ...]

    @property
    def busiest(self) -> float:
        return max(self.cpu_s_per_s, default=0.0)

    @property
    def saturated(self) -> bool:
        return self.busiest >= CLIENT_BUSY

    def record(self) -> dict[str, Any]:
        return {"processes": len(self.cpu_s_per_s), "cpu_s_per_s": [round(x, 3) for x in self.cpu_s_per_s],
                "busiest_cpu_s_per_s": round(self.busiest, 3), "saturated": self.saturated}

    def warning(self) -> str | None:
        """A line for a person reading the report, when a client process was busy enough to pace the load."""
        if not self.saturated:
            return None
        n = len(self.cpu_s_per_s)
        return (f"warning: a client process was busy {self.busiest:.0%} of the run ({n} process{'es' * (n > 1)}): "
                f"chunk gaps and TTFT may be the client's own; send the load from more processes "
                f"(--client-processes {2 * n})")


def fan_out(fn: Callable[..., Any], args: tuple, count: int, timeout_s: float,
            progress: Callable[[list[int]], None] | None = None) -> list[tuple[Any, float]]:
    """Run `await fn(share, t0, counts, *args)` in `count` spawned processes, share i of count each, all told the
    same start instant t0 (time.perf_counter: one clock for every process of the machine). `counts` is a shared
    array of 3 x count integers where process i may keep its requests sent, done and failed (counts[3i:3i+3]);
    `progress`, if given, is called with all of them about every 0.25 s. Returns [(what fn returned, its process's
    CPU seconds per second from t0 to its return)] in share order."""
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    go = ctx.Event()
    start = ctx.Value("d", 0.0)
    counts = ctx.Array("q", 3 * count)  # sent, done, failed per process, for a progress bar
    procs = [ctx.Process(target=_child, args=(fn, Share(i, count), args, ready, go, start, counts, out),
                         name=f"pdserve-bench-client-{i}", daemon=True) for i in range(count)]
    for p in procs:
        p.start()
    try:
        _await_ready(ready, procs)
        start.value = time.perf_counter() + START_MARGIN_S
        go.set()
        got = _collect(out, procs, start.value + timeout_s, counts, progress)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [got[i] for i in range(count)]


def _await_ready(ready: Any, procs: list) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    seen = 0
    while seen < len(procs):
        try:
            ready.get(timeout=0.25)
            seen += 1
        except queue.Empty:
            _check_alive(procs, set())
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(procs) - seen} client processes not ready after {READY_TIMEOUT_S:g} s") \
                    from None


def _collect(out: Any, procs: list, deadline: float, counts: Any,
             progress: Callable[[list[int]], None] | None) -> dict[int, tuple[Any, float]]:
    got: dict[int, tuple[Any, float]] = {}
    while len(got) < len(procs):
        try:
            index, ok, value, cpu = out.get(timeout=0.25)
        except queue.Empty:
            _check_alive(procs, set(got))
            if time.perf_counter() > deadline:
                raise RuntimeError(f"client processes {sorted(set(range(len(procs))) - set(got))} did not finish "
                                   "within their timeout") from None
        else:
            if not ok:
                raise RuntimeError(f"client process {index} failed:\n{value}")
            got[index] = (value, cpu)
        if progress is not None:
            progress(list(counts))
    return got


def _check_alive(procs: list, finished: set[int]) -> None:
    for i, p in enumerate(procs):
        if i not in finished and not p.is_alive() and p.exitcode not in (None, 0):
            raise RuntimeError(f"client process {i} exited with code {p.exitcode} before it reported")


def _child(fn: Callable[..., Any], share: Share, args: tuple, ready: Any, go: Any, start: Any, counts: Any,
           out: Any) -> None:
    import asyncio
    import os
    import threading

    def orphaned() -> None:  # a load generator whose parent was killed (SIGKILL: no clean-up) stops, too
        mp.parent_process().join()
        os._exit(1)
    threading.Thread(target=orphaned, name="parent-watch", daemon=True).start()
    try:
        ready.put(share.index)
        if not go.wait(READY_TIMEOUT_S + 60):
            raise RuntimeError("the common start never came")
        t0 = start.value
        cpu0 = time.process_time()
        value = asyncio.run(fn(share, t0, counts, *args))
        wall = max(time.perf_counter() - t0, 1e-9)
        out.put((share.index, True, value, (time.process_time() - cpu0) / wall))
    except BaseException:  # the parent reports it, naming this process
        out.put((share.index, False, traceback.format_exc()[-4000:], 0.0))
