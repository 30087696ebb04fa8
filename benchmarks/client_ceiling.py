"""How many chunks a second `pdserve bench`'s client measures truly, from one process and from several.

A paced SSE server (a bare asyncio HTTP/1.1 server in a process of its own: no model, no tokenizer) streams
`--streams` completions at once, each one OpenAI-shaped chunk every `--step-ms` (a decode step of that length for
the whole batch), `--chunks` of them. The reference in the same run is that pace: a client that keeps up records a
median chunk gap equal to the step; one that does not records gaps of ~0 (chunks read together from its socket
buffer) and a CPU near 1. For each step and client process count it prints one JSON line: the offered chunks/s,
the chunk gap p50 against the step, and each client process's CPU seconds per second (benchclient.client_processes).

    python benchmarks/client_ceiling.py --steps-ms 10,5,3 --processes 1,2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchclient.arrivals import ArrivalSpec  # noqa: E402
from benchclient.client import Target  # noqa: E402
from benchclient.run import RunConfig, measured_load  # noqa: E402
from benchclient.stats import percentile  # noqa: E402
from benchclient.workload_spec import WorkloadSpec  # noqa: E402

SERVER = r'''
import asyncio, json, sys
port, chunks, step = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]) / 1000
piece = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "text": " word", "logprobs": None, "finish_reason": None}]}
usage = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m", "choices": [],
         "usage": {"prompt_tokens": 4, "completion_tokens": chunks, "total_tokens": chunks + 4}}
def framed(obj):
    data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)
EVENT, USAGE, DONE = framed(piece), framed(usage), framed(b"[DONE]")
async def handle(reader, writer):
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")), 0)
    await reader.readexactly(length)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                 b"connection: close\r\n\r\n")
    loop = asyncio.get_running_loop()
    due = loop.time()
    for _ in range(chunks):  # one write a chunk, on a fixed schedule: a decode step's pace
        writer.write(EVENT)
        await writer.drain()
        due += step
        await asyncio.sleep(max(0.0, due - loop.time()))
    writer.write(USAGE + DONE + b"0\r\n\r\n")
    await writer.drain()
    writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()
asyncio.run(main())
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one(step_ms: float, processes: int, args: argparse.Namespace) -> dict:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(args.chunks), str(step_ms)],
                              stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise SystemExit("the paced SSE server did not start")
        cfg = RunConfig(target=Target(url=f"http://127.0.0.1:{port}", model="m"),
                        workload=WorkloadSpec(kind="fixed", input_len=4, output_len=args.chunks, prompt_format="ids"),
                        arrival=ArrivalSpec(kind="concurrency", concurrency=args.streams), num_requests=args.streams,
                        warmup_s=0, timeout_s=120, client_processes=processes)
        run = asyncio.run(measured_load(cfg))
    finally:
        server.kill()
        server.wait()
    wall = max(r.end for r in run.results) - min(r.start for r in run.results)  # first send to last end
    gaps = [g for r in run.results for g in r.itl]
    gap_p50 = percentile(gaps, 50) * 1000
    return {"step_ms": step_ms, "client_processes": processes, "streams": args.streams,
            "offered_chunks_per_s": round(args.streams * 1000 / step_ms), "failed": sum(not r.ok for r in run.results),
            "received_chunks_per_s": round(sum(len(r.chunk_times) for r in run.results) / wall),
            "chunk_gap_ms_p50": round(gap_p50, 3), "gap_p50_over_step": round(gap_p50 / step_ms, 3),
            "client_cpu_s_per_s": [round(x, 3) for x in run.client.cpu_s_per_s]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps-ms", default="10,5,3", help="the server's pace between a stream's chunks")
    parser.add_argument("--processes", default="1,2", help="client process counts to try")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=400, help="chunks a stream")
    args = parser.parse_args()
    for step in (float(x) for x in args.steps_ms.split(",")):
        for processes in (int(x) for x in args.processes.split(",")):
            print(json.dumps(one(step, processes, args)), flush=True)


if __name__ == "__main__":
    main()
