"""Notification latency: `KVAgent.notify(remote, msg)` on one process -> the peer's `on_notification` listener.

Two processes, one KVAgent each (ucxx Python futures on, as in the pool workers: `worker_setup.start_agent`), on
this host over UCX. The driver's main thread calls `notify("peer", msg)`; the peer's listener (on its agent's loop
thread) notifies straight back; the driver's listener stamps the arrival. One at a time, N times. Reported:

  one_way (clock)  peer listener's time.time() - the driver's time.time() at the notify call (same host clock)
  rtt/2            the ping-pong's round trip halved (perf_counter, driver only)

next to two references measured in the same run, with the same shape (a caller thread hands the message to a
loop thread, peer loop answers from its loop thread, the driver's loop stamps the answer):

  socket rtt/2     the ping-pong over a plain asyncio Unix socket between the same two processes
  hop              a bare hop from the driver's main thread onto its agent's loop thread (call_soon_threadsafe)

and the ratios notify/socket and notify/hop. Run:

  python benchmarks/notify_latency.py [--n 300] [--warmup 30] [--size 64] [--repeat 3] [--no-python-futures]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time
from typing import Any

import torch

from engine.kv_layout import KVCacheSpec

SPEC = KVCacheSpec("notify-bench", num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="bfloat16")


def _agent(name: str, port: int, futures: bool) -> Any:
    from kvtransfer.agent import AgentConfig, KVAgent
    from kvtransfer.backends.ucx import use_python_futures

    if futures:
        use_python_futures()
    agent = KVAgent(name, AgentConfig(backends=("ucx",)), address="127.0.0.1", port=port)
    agent.register_cache(torch.zeros(SPEC.shape(4), dtype=torch.bfloat16), SPEC)
    return agent


def _sock_echo(path: str, ready: Any) -> threading.Thread:
    """A loop thread serving the Unix-socket echo (the reference ping-pong's peer side)."""
    def run() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                try:
                    size = int.from_bytes(await reader.readexactly(4), "little")
                    data = await reader.readexactly(size)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                writer.write(len(data).to_bytes(4, "little") + data)

        async def main() -> None:
            await asyncio.start_unix_server(serve, path)
            ready.set()
            await asyncio.Event().wait()

        asyncio.run(main())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _peer(conn: Any, port: int, futures: bool, sock_path: str) -> None:
    agent = _agent("peer", port, futures)
    arrivals: list[float] = []

    def listener(sender: str, msg: bytes) -> None:
        now = time.time()
        arrivals.append(now - float(msg[:20]))
        agent.notify(sender, msg)  # straight back, from this loop thread

    agent.on_notification(listener)
    ready = threading.Event()
    _sock_echo(sock_path, ready)
    ready.wait(10)
    conn.send(agent.metadata().to_bytes())
    while True:
        cmd, arg = conn.recv()
        if cmd == "add":
            agent.add_remote(arg)
            conn.send(None)
        elif cmd == "arrivals":
            conn.send(arrivals[:])
            arrivals.clear()
        elif cmd == "close":
            agent.close()
            conn.send(None)
            return


def _free_ports(lo: int, hi: int, k: int) -> list[int]:
    """k ports in [lo, hi) that bind now without SO_REUSEADDR (so none is held by a TIME_WAIT of an earlier run)."""
    out = []
    for p in range(lo, hi):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", p))
            except OSError:
                continue
        out.append(p)
        if len(out) == k:
            return out
    raise RuntimeError(f"no {k} free ports in {lo}-{hi - 1}")


def _q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def _stats(xs_s: list[float]) -> dict:
    us = [x * 1e6 for x in xs_s]
    return {"p50_us": round(_q(us, 0.5), 1), "p90_us": round(_q(us, 0.9), 1), "mean_us": round(statistics.mean(us), 1)}


def bench_notify(agent: Any, n: int, warmup: int, size: int) -> list[float]:
    got = threading.Event()
    stamp: list[float] = [0.0]

    def listener(sender: str, msg: bytes) -> None:
        stamp[0] = time.perf_counter()
        got.set()

    agent.on_notification(listener)
    rtts: list[float] = []
    for i in range(warmup + n):
        got.clear()
        t0 = time.perf_counter()
        msg = f"{time.time():20.6f}".encode() + b"x" * max(0, size - 20)
        h = agent.notify("peer", msg)
        if not got.wait(10):
            raise TimeoutError(f"notification {i} did not come back: {h}")
        h.wait(10)
        if i >= warmup:
            rtts.append(stamp[0] - t0)
    return rtts


def bench_socket(path: str, n: int, warmup: int, size: int) -> list[float]:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    got = threading.Event()
    stamp: list[float] = [0.0]
    io: dict = {}

    async def connect() -> None:
        io["r"], io["w"] = await asyncio.open_unix_connection(path)

        async def reader() -> None:
            while True:
                k = int.from_bytes(await io["r"].readexactly(4), "little")
                await io["r"].readexactly(k)
                stamp[0] = time.perf_counter()
                got.set()

        io["task"] = asyncio.ensure_future(reader())

    asyncio.run_coroutine_threadsafe(connect(), loop).result(10)
    payload = b"x" * size
    rtts = []
    for i in range(warmup + n):
        got.clear()
        t0 = time.perf_counter()
        loop.call_soon_threadsafe(io["w"].write, len(payload).to_bytes(4, "little") + payload)
        got.wait(10)
        if i >= warmup:
            rtts.append(stamp[0] - t0)

    async def shut() -> None:
        io["task"].cancel()
        io["w"].close()

    asyncio.run_coroutine_threadsafe(shut(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    return rtts


def bench_hop(agent: Any, n: int, warmup: int) -> list[float]:
    got = threading.Event()
    stamp: list[float] = [0.0]

    def on_loop() -> None:
        stamp[0] = time.perf_counter()
        got.set()

    out = []
    for i in range(warmup + n):
        got.clear()
        t0 = time.perf_counter()
        agent._loop.loop.call_soon_threadsafe(on_loop)
        got.wait(10)
        if i >= warmup:
            out.append(stamp[0] - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--size", type=int, default=64, help="message bytes (at least 20: a timestamp leads)")
    ap.add_argument("--ports", default="19600-19699", help="the two listeners take the first free ports here")
    ap.add_argument("--no-python-futures", action="store_true", help="ucxx's default request wait (polling)")
    ap.add_argument("--repeat", type=int, default=1, help="alternate notify and socket rounds this many times")
    args = ap.parse_args()
    futures = not args.no_python_futures
    lo, hi = (int(x) for x in args.ports.split("-"))
    port, peer_port = _free_ports(lo, hi + 1, 2)
    sock_path = f"/tmp/notify_latency_{os.getpid()}.sock"
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child, peer_port, futures, sock_path), daemon=True)
    proc.start()
    try:
        if not conn.poll(60):
            raise TimeoutError("the peer did not start")
        peer_meta = conn.recv()
        agent = _agent("driver", port, futures)
        agent.add_remote(peer_meta)
        conn.send(("add", agent.metadata().to_bytes()))
        conn.recv()
        notify_rtt: list[float] = []
        one_way: list[float] = []
        sock_rtt: list[float] = []
        for _ in range(args.repeat):
            notify_rtt += bench_notify(agent, args.n, args.warmup, max(20, args.size))
            conn.send(("arrivals", None))
            one_way += conn.recv()[args.warmup:]
            sock_rtt += bench_socket(sock_path, args.n, args.warmup, max(20, args.size))
        hop = bench_hop(agent, args.n, args.warmup)
        n_half = [x / 2 for x in notify_rtt]
        s_half = [x / 2 for x in sock_rtt]
        res = {
            "n": len(notify_rtt), "size": max(20, args.size), "python_futures": futures,
            "notify_one_way_clock": _stats(one_way), "notify_rtt_half": _stats(n_half),
            "socket_rtt_half": _stats(s_half), "hop": _stats(hop),
            "ratio_notify_vs_socket_p50": round(_q(n_half, 0.5) / _q(s_half, 0.5), 2),
            "ratio_notify_vs_hop_p50": round(_q(n_half, 0.5) / _q(hop, 0.5), 2),
        }
        print(json.dumps(res))
        conn.send(("close", None))
        conn.poll(20) and conn.recv()
        agent.close()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        if os.path.exists(sock_path):
            os.unlink(sock_path)


if __name__ == "__main__":
    main()
