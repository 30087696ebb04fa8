"""One streamed request to an OpenAI-compatible endpoint, timed as its bytes arrive.

Owns `SSEParser` (bytes in, complete `data:` events out, each stamped with the arrival time of the bytes that
completed it) and `stream_request`, which returns a `RequestResult` for every request: a failure (HTTP status,
an in-band error event, a stream cut before `[DONE]`, a timeout or connection error) is a result with `error`
set, never an exception and never dropped. Token counts come from the stream's usage chunk
(`stream_options.include_usage`); only when a server sends no usage does the count fall back to output chunks,
and the result says so (`tokens_from_usage=False`). With `Target.phases` the request asks pdserve for its phases
(`stream_options.include_phases`), which the usage chunk carries: seconds per phase as the server measured them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from benchclient.workload import BenchRequest


@dataclass
class RequestResult:
    """Times are seconds on the driver's clock (`time.perf_counter`); `chunk_times` holds the arrival of every
    output chunk: every event with a choice, as vLLM's benchmark counts them (the first is the first token; a later
    one may carry several tokens, or tokens whose text the server still holds back, or only the finish reason)."""

    start: float
    input_len: int
    max_tokens: int
    warmup: bool = False
    chunk_times: list[float] = field(default_factory=list)
    end: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    tokens_from_usage: bool = False
    finish_reason: str | None = None
    error: str | None = None
    phases: dict[str, float] | None = None  # the server's phases of the request (pdserve, when asked for)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server reports it
    text: str = ""                    # the output text (a multi-turn conversation resends it)
    conversation: int | None = None   # `multiturn`: which conversation and which turn (0 first) it is
    turn: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (completion_tokens - 1)."""
        if not self.ok or self.ttft is None or self.e2e is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    @property
    def itl(self) -> list[float]:
        """Gaps between successive output chunks (a chunk may carry several tokens)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


class SSEParser:
    """Incremental server-sent-events framing: `feed(bytes, t)` returns [(t, data)] for each event completed."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes, t: float) -> list[tuple[float, str]]:
        self._buf += data.replace(b"\r\n", b"\n")
        out = []
        while b"\n\n" in self._buf:
            raw, self._buf = self._buf.split(b"\n\n", 1)
            lines = [ln[5:].lstrip() for ln in raw.decode("utf-8").split("\n") if ln.startswith("data:")]
            if lines:
                out.append((t, "\n".join(lines)))
        return out


@dataclass(frozen=True)
class Target:
    url: str                       # base URL, e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None
    ignore_eos: bool = False       # pdserve and vLLM accept it; exact output lengths
    temperature: float = 0.0
    phases: bool = False           # ask pdserve for the request's phases (stream_options.include_phases)

    def path(self) -> str:
        base = self.url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        return f"{base}/chat/completions" if self.endpoint == "chat" else f"{base}/completions"

    def body(self, req: BenchRequest) -> dict:
        options = {"include_usage": True, **({"include_phases": True} if self.phases else {})}
        body: dict = {"model": self.model, "max_tokens": req.max_tokens, "stream": True, "stream_options": options,
                      "temperature": self.temperature}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "chat":
            if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], dict):
                raise ValueError("token-id prompts need the completions endpoint")
            body["messages"] = req.prompt if isinstance(req.prompt, list) else [
                {"role": "user", "content": req.prompt}]
        else:
            if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], dict):
                raise ValueError("chat-message prompts need the chat endpoint")
            body["prompt"] = req.prompt
        return body

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def first_model(url: str, api_key: str | None = None) -> str:
    return list_models(url, api_key)[0]["id"]


def serves_pdserve(url: str, api_key: str | None = None) -> bool:
    """Whether the server is pdserve (its /v1/models entries are owned_by "pdserve"); False if it cannot say."""
    try:
        return any(m.get("owned_by") == "pdserve" for m in list_models(url, api_key) if isinstance(m, dict))
    except ValueError:
        return False


def list_models(url: str, api_key: str | None = None) -> list:
    """The entries of the server's /v1/models (ValueError if it cannot be read or lists none)."""
    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{base}/models", headers=headers, timeout=30)
        r.raise_for_status()
        models = r.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise ValueError(f"cannot list the models at {base}/models ({e}); pass --model") from None
    if not models:
        raise ValueError(f"{base}/models lists no model; pass --model")
    return models


async def stream_request(client: httpx.AsyncClient, target: Target, req: BenchRequest, warmup: bool = False,
                         clock: Callable[[], float] = time.perf_counter) -> RequestResult:
    result = RequestResult(start=clock(), input_len=req.input_len, max_tokens=req.max_tokens, warmup=warmup)
    try:
        async with client.stream("POST", target.path(), json=target.body(req), headers=target.headers()) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {r.status_code}: {text[:200]}"
                result.end = clock()
                return result
            parser, done = SSEParser(), False
            async for data in r.aiter_raw():
                for t, event in parser.feed(data, clock()):
                    done = _on_event(result, t, event) or done
            result.end = clock()
            if result.error is None and not done:
                result.error = "stream ended without [DONE]"
    except (httpx.HTTPError, ValueError, UnicodeDecodeError) as e:
        result.end = clock()
        result.error = f"{type(e).__name__}: {e}"[:300]
    if result.ok and not result.tokens_from_usage:
        result.completion_tokens = len(result.chunk_times)
    if result.ok and not result.chunk_times:
        result.error = "no output chunk"
    return result


def _on_event(result: RequestResult, t: float, event: str) -> bool:
    """Record one event; True on `[DONE]`."""
    if event == "[DONE]":
        return True
    obj = json.loads(event)
    if "error" in obj:
        err = obj["error"]
        result.error = result.error or f"in-band error: {err.get('message', err) if isinstance(err, dict) else err}"
        return False
    if obj.get("usage"):
        result.prompt_tokens = obj["usage"].get("prompt_tokens")
        result.completion_tokens = obj["usage"].get("completion_tokens", 0)
        result.tokens_from_usage = True
        if isinstance(obj.get("phases"), dict):
            result.phases = obj["phases"]
        details = obj["usage"].get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            result.cached_tokens = details["cached_tokens"]
    for choice in obj.get("choices") or []:
        result.chunk_times.append(t)
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
        delta = choice.get("delta")
        result.text += (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")
        break
    return False
