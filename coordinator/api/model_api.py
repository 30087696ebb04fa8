"""The model's description and tokenizer over HTTP, in vLLM's shapes: GET /v1/models, GET /version, POST /tokenize,
POST /detokenize (a FastAPI router that create_app includes; state on app.state: backend, settings, tokenizer,
model_name, tenants).

The served model's id (`model_id`) is `server.served_model_name`, else the configured `model` when it is a name
(`tiny`), else the checkpoint folder's name: a filesystem path is never shown. vLLM lists the path it was given, so
with no served_model_name a request naming that path (the configured `model`) is served too (`accepts`): clients
written against vLLM keep working; /v1/models lists only the id (and, as `root`, the model's own name: the
configured name or the folder's, never its path).

/v1/models, /tokenize and /detokenize take the same API key as /v1 (401 without it); /version answers anyone, as
/health does. A body is read under the server's limits (coordinator.api.http_body) and validated strictly: an unknown
field is a 400 naming it, as on /v1 (coordinator.api.protocol). `model` may be left out (vLLM's default model); another
model than the served one is a 404.

/tokenize takes either `prompt` (a string, encoded as /v1/completions encodes it: with the tokenizer's special
tokens unless `add_special_tokens` is false) or `messages` (rendered by the chat template exactly as
/v1/chat/completions renders them, with `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs` and
`tools`, so its count is
the prompt_tokens a chat request with the same fields reports; `add_special_tokens` must stay false there: the
template writes the special tokens), and returns `count`, `max_model_len`, `tokens` and
`token_strs` (each id's vocabulary string when `return_token_strs`, else null). /detokenize takes `tokens`, ids in
the vocabulary, and returns the `prompt` they decode to, special tokens included, so it inverts /tokenize.
"""

from __future__ import annotations

import asyncio
import time
from importlib import metadata
from pathlib import PurePath
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from coordinator import errors
from coordinator.api import engine_inputs, protocol
from coordinator.api.http_body import read_json
from coordinator.api.tool_calls import MAX_TOOLS, Tool

router = APIRouter()
STARTED = int(time.time())


def package_version() -> str:
    """pdserve's version from the installed package's metadata (a checkout run without `pip install` has none)."""
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)  # as /v1's bodies


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[protocol.ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    state = _authorized(request)
    backend = state.backend
    return JSONResponse({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": STARTED, "owned_by": "pdserve",
        "root": model_id(backend.model_name, backend.model_path, None), "parent": None,
        "max_model_len": backend.max_model_len}]})


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": package_version()})


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    state = _authorized(request)
    body = await _body(request)
    chat = isinstance(body, dict) and "messages" in body
    if chat and "prompt" in body:
        raise errors.invalid_request("prompt: give either prompt or messages, not both", "prompt")
    req = protocol.parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)  # type: ignore[arg-type]
    _check_model(state, req.model)
    ids = await asyncio.to_thread(_encode, req, state)
    strs = [state.tokenizer.id_to_token(i) or "" for i in ids] if req.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": state.backend.max_model_len, "tokens": ids,
                         "token_strs": strs})


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    state = _authorized(request)
    req = protocol.parse(DetokenizeRequest, await _body(request))  # type: ignore[arg-type]
    _check_model(state, req.model)
    vocab = state.backend.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise errors.invalid_request(f"tokens: token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
    text = await asyncio.to_thread(state.tokenizer.decode, req.tokens, False)
    return JSONResponse({"prompt": text})


def _authorized(request: Request) -> Any:
    state = request.app.state
    state.tenants.authenticate(request.headers.get("authorization"))
    return state


async def _body(request: Request) -> Any:
    settings = request.app.state.settings
    return await read_json(request, settings.max_body_bytes, settings.body_read_timeout_s)


def model_id(configured: str, folder: str, served_model_name: str | None) -> str:
    """The id clients see: served_model_name, else the configured model when it is a name, else its folder's name
    (`folder`: the checkpoint folder it resolved to)."""
    if served_model_name:
        return served_model_name
    if "/" not in configured and "\\" not in configured and configured not in ("", ".", ".."):
        return configured
    return PurePath(folder).name or PurePath(configured.rstrip("/\\")).name or "model"


def accepts(state: Any, model: str) -> bool:
    """Whether a request naming `model` is for the served model: its id, or (no served_model_name) the configured
    model as given, the id vLLM would have listed."""
    return model == state.model_name or (not state.settings.served_model_name and model == state.backend.model_name)


def _check_model(state: Any, model: str | None) -> None:
    if model is not None and not accepts(state, model):
        raise errors.model_not_found(model, state.model_name)


def _encode(req: TokenizeCompletionRequest | TokenizeChatRequest, state: Any) -> list[int]:
    if isinstance(req, TokenizeCompletionRequest):
        return state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    if req.add_special_tokens:
        raise errors.invalid_request("add_special_tokens: must be false for messages (the chat template writes the "
                                     "special tokens)", "add_special_tokens")
    chat = protocol.parse(protocol.ChatCompletionRequest, {  # the chat endpoint's own checks and rendering
        "model": state.model_name, "messages": [m.model_dump(exclude_unset=True) for m in req.messages],
        "continue_final_message": req.continue_final_message, "chat_template_kwargs": req.chat_template_kwargs,
        **({"add_generation_prompt": req.add_generation_prompt} if "add_generation_prompt" in req.model_fields_set
           else {}),
        "tools": None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools]})
    return engine_inputs.prompt_token_ids(chat, state.tokenizer, state.backend.vocab_size,
                                     state.settings.allow_special_tokens_in_content)
