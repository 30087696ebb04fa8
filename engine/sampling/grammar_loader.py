"""GrammarLoader: an engine's structured-output machinery (engine.sampling.grammar) built on a thread of its own.

A pool worker starts it with its engine, beside the engine's load (LLMEngine `grammar_at_start`), so neither its
start nor its engine thread waits for the grammar library's import and its view of the vocabulary, and the build's
hold of the GIL (below) falls in the load, before the worker serves anything. Until the build is done the engine
holds the structured requests that arrive (LLMEngine: they wait, holding nothing but a hand-over's booked blocks)
and keeps stepping every other request; `on_ready` wakes the engine's owner when it ends.

Owns the thread and the outcome: `manager()` is the GrammarManager once built, None while building; a failed
build (llguidance missing, a tokenizer it refuses) raises its error from `manager()` every time, so each
structured request held or arriving gets it. `seconds` is how long the build took (0 until it ended), `thread` the
name of the thread that ran it.

What the build costs, measured on the 2-core CPU machine: the library's tokenizer tables take 22 ms for `tiny`'s
2,048 tokens and about 1 s for a 128k vocabulary; llguidance 1.9's constructor holds the GIL for all of it, so the
engine thread pauses that long once, whatever thread builds them: built after start, as until 2026-12-03, that pause
came right after the worker became routable (on an H200 it also held back the worker's next reply by ~1 s:
docs/benchmark-log.md, worker start on one H200). llguidance has no way to save
those tables and load them again (no serialization; building from cached token bytes measured no faster), so there
is nothing to cache on disk: the tables are built once per worker start, off every request's path.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sampling.grammar import GrammarManager


class GrammarLoader:
    def __init__(self, build: Callable[[], GrammarManager], on_ready: Callable[[], None] | None = None) -> None:
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._build = build
        self._on_ready = on_ready
        self._lock = threading.Lock()  # on_ready set (notify) against the build ending
        self.seconds = 0.0
        self.thread = ""
        threading.Thread(target=self._run, name="grammar-load", daemon=True).start()

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the build has ended (built or failed) or `timeout` s passed; True if it has ended."""
        done, _ = concurrent.futures.wait([self._future], timeout)
        return bool(done)

    def notify(self, on_ready: Callable[[], None]) -> None:
        """Call `on_ready()` when the build ends (now, on this thread, if it has ended), instead of the one given
        at construction."""
        with self._lock:
            if not self._future.done():
                self._on_ready = on_ready
                return
        on_ready()

    def manager(self) -> GrammarManager | None:
        """The built GrammarManager; None while building; the build's error if it failed."""
        if not self._future.done():
            return None
        return self._future.result()

    def _run(self) -> None:
        start = time.monotonic()
        self.thread = threading.current_thread().name
        try:
            built, error = self._build(), None
        except BaseException as e:  # noqa: BLE001 - handed to every structured request (manager())
            built, error = None, e
        self.seconds = time.monotonic() - start  # before done() says so
        with self._lock:
            if error is None:
                self._future.set_result(built)
            else:
                self._future.set_exception(error)
            on_ready = self._on_ready
        if on_ready is not None:
            on_ready()
