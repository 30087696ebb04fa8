"""Test fixture: a real ServingBackend running a real engine.LLMEngine in-process, and a uvicorn server in a thread.

InProcessBackend: one asyncio task owns the engine and steps it (`await asyncio.to_thread(engine.step)`);
generate() only queues an "add" for that loop, and closing a stream queues an "abort", so the engine is touched by
the loop alone, between steps. Step outputs go to per-request asyncio queues. It counts generate() calls and aborts,
and after every step and every batch of commands records `engine.check_integrity()` (`self.integrity`), so tests
can assert that nothing is left in use. Knobs for tests: `fail_with` makes generate() raise (Overloaded,
BackendError); `fail_stream_after = n` ends streams with BackendError after n deltas; `pause()` stops stepping
(commands, such as aborts, are still applied) until `resume()`, and `pause_after(n)` pauses once n more steps
have run (so a test knows exactly how far a request got, however slow the machine); all safe from any thread.
Not product code: the product backend is the Ray pools.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import uvicorn

from coordinator.api.http_server import uvicorn_config
from coordinator.config.settings import ServerSettings
from coordinator.contract import BackendError, GenerateRequest, TokenDelta
from engine.llm_engine import LLMEngine


class InProcessBackend:
    def __init__(self, engine: LLMEngine, model_path: str | Path, model_name: str = "tiny") -> None:
        self.engine = engine
        self.model_name = model_name
        self.model_path = str(model_path)
        self.max_model_len = engine.config.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.generate_calls = 0
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.fail_with: BaseException | None = None
        self.fail_stream_after: int | None = None
        self._paused = threading.Event()
        self._steps_left: int | None = None  # pause once this many more steps have returned outputs
        self.integrity: dict[str, int] = engine.check_integrity()
        self._commands: list[tuple] = []
        self._streams: dict[str, asyncio.Queue] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def start(self) -> None:
        self._stopping = False
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop())

    async def shutdown(self) -> None:
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            await asyncio.wait_for(self._task, 30)
        for rid in list(self.engine.scheduler.requests):
            self.engine.abort(rid)
        for q in self._streams.values():
            q.put_nowait(BackendError("backend shut down"))
        self.integrity = self.engine.check_integrity()

    def stats(self) -> dict:
        sched, counts = self.engine.scheduler, self.integrity
        return {"queue_length": len(sched.waiting), "transfer": {"bytes_total": 0},
                "workers": [{"name": "inprocess-0", "role": "both", "running": len(sched.running),
                             "queued_prompt_tokens": sum(len(r.prompt_token_ids) for r in sched.waiting),
                             "free_blocks": counts["free"] + counts["cached"], "total_blocks": counts["total"]}]}

    def pause(self) -> None:
        self._paused.set()

    def pause_after(self, steps: int) -> None:
        self._steps_left = steps

    def resume(self) -> None:
        self._steps_left = None
        self._paused.clear()

    @property
    def idle(self) -> bool:
        """No request left anywhere and no block in use (as of the loop's last look)."""
        return (not self._streams and not self._commands and self.integrity["in_use"] == 0
                and self.integrity["pinned"] == 0 and not self.engine.scheduler.requests)

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        self.generate_calls += 1
        if self.fail_with is not None:
            raise self.fail_with
        queue: asyncio.Queue = asyncio.Queue()
        self._commands.append(("add", request, queue))
        assert self._wake is not None, "InProcessBackend.start() was not awaited"
        self._wake.set()
        return self._stream(request.request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[TokenDelta]:
        done = False
        delivered = 0
        try:
            while True:
                if self.fail_stream_after is not None and delivered >= self.fail_stream_after:
                    raise BackendError("injected failure: the decode worker died")
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finish_reason is not None
                delivered += 1
                yield item
                if done:
                    return
        finally:
            if not done:
                self.aborted.append(request_id)
                self._commands.append(("abort", request_id))
                self._wake.set()

    async def _loop(self) -> None:
        while not self._stopping:
            self._apply_commands()
            if self._paused.is_set():
                await asyncio.sleep(0.005)
                continue
            if not self.engine.has_unfinished():
                self._wake.clear()
                if not self._commands:
                    await self._wake.wait()
                continue
            outputs = await asyncio.to_thread(self.engine.step)
            if self._steps_left is not None and outputs:  # a step that only queued work (overlap) delivers nothing
                self._steps_left -= 1
                if self._steps_left <= 0:
                    self._steps_left = None
                    self._paused.set()
            for out in outputs:
                queue = self._streams.get(out.request_id)
                if queue is None:
                    continue
                queue.put_nowait(TokenDelta(out.new_token_ids, out.new_logprobs, out.finish_reason,
                                            cached_tokens=out.num_cached_tokens))
                if out.finish_reason is not None:
                    del self._streams[out.request_id]
                    self.finished.append(out.request_id)
            self.integrity = self.engine.check_integrity()

    def _apply_commands(self) -> None:
        commands, self._commands = self._commands, []
        for cmd in commands:
            if cmd[0] == "add":
                _, req, queue = cmd
                try:
                    self.engine.add_request(req.request_id, req.prompt_token_ids, req.params)
                    self._streams[req.request_id] = queue
                except ValueError as e:
                    queue.put_nowait(BackendError(str(e)))
            else:
                self._streams.pop(cmd[1], None)
                self.engine.abort(cmd[1])
        if commands:
            self.integrity = self.engine.check_integrity()


class ServerThread:
    """A real uvicorn server for `app` on 127.0.0.1 (a free port), in a thread with its own event loop.
    `backend.start()`/`shutdown()` run on that loop, so the backend's task lives where the requests do."""

    def __init__(self, app, backend: InProcessBackend) -> None:
        self.app, self.backend = app, backend
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # the product's HTTP protocol and timeouts (coordinator.api.http_server.uvicorn_config), default settings
        self.server = uvicorn.Server(uvicorn_config(app, ServerSettings(), log_config=None, log_level="warning",
                                                    lifespan="on"))
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.backend.start()
        try:
            await self.server.serve(sockets=[self.sock])
        finally:
            await self.backend.shutdown()

    def call(self, coro, timeout: float = 30.0):
        """Run a coroutine on the server's loop (e.g. lifecycle.wait_idle) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self.sock.close()
        assert not self._thread.is_alive(), "uvicorn did not stop"


async def _with_backend(app, backend: InProcessBackend, fn, timeout: float):
    await backend.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return await asyncio.wait_for(fn(client), timeout)
    finally:
        await backend.shutdown()


def run_asgi(app, backend: InProcessBackend, fn, timeout: float = 30.0):
    """Start the backend on a fresh loop, run `await fn(client)` with an httpx client on the app (in-process ASGI,
    no streaming), shut the backend down, return fn's result."""
    return asyncio.run(_with_backend(app, backend, fn, timeout))


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
