"""The OpenAI request bodies (pydantic, strict types): what a valid /v1/completions or /v1/chat/completions body is.

Owns: the request models (types, ranges, unsupported options), `parse` and the OpenAI `param` name of a validation
error. Their translation into engine inputs (token ids, max_tokens, SamplingParams) is coordinator.api.engine_inputs.
No parameter is silently ignored: a field the models below do not declare is a 400 naming it (`param` = the field,
nested ones as `stream_options.x`), and a declared option this server does not implement
is refused when set to anything but its default. docs/parameters.md's request-parameter table lists every field
(tests/test_api_parameters.py keeps the two in step). Accepted without changing the output, each in a stated way:
`user` and `metadata` (at most 16 string pairs) are logged with the request id (logger `coordinator.requests`,
INFO); `store` is accepted only as false or null (this server stores nothing; true is a 400).
Vendor extensions accepted on both endpoints (vLLM's names and meanings): `top_k`, `min_p`, `ignore_eos`,
`stop_token_ids`, `priority` (lower first, or high | normal | low, clamped to the tenant's class),
`return_token_ids` (each choice's generated ids as `token_ids`, the prompt's as `prompt_token_ids`: on the chat
response, on each completion choice; streamed, every chunk's new ids and the prompt's on a choice's first chunk),
`return_tokens_as_token_ids` (logprobs' token strings, alternatives and echoed prompt tokens included, read
`token_id:<id>`; their `bytes` stay the token's own); on chat also
`add_generation_prompt`, `continue_final_message` (the prompt ends inside the last message, which the output
continues; with add_generation_prompt true a 400, as vLLM; left out, it is false), `echo` (chat_echo) and
`chat_template_kwargs` (keys in TEMPLATE_KWARGS). pdserve's own extension:
`stream_options.include_phases` (with `include_usage`): the usage chunk carries the request's phases
(coordinator.observability.phases).

Hostile-input rules: every float must be finite (`1e999` parses to infinity: a 400 naming the field); a message's
role is one of ROLES; its content is a string or text parts, and null (or absent) only on an assistant message
that carries `tool_calls` (OpenAI's one legal case); `chat_template_kwargs` keys are limited to
TEMPLATE_KWARGS (a 400 names any other key); special-token text in message content is encoded as text unless
`server.allow_special_tokens_in_content` (Tokenizer.encode_chat). A completion `prompt` string is the model's raw
input (its special-token text is parsed, as token-id prompts are accepted anyway).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from coordinator.api.sampling_fields import SamplingFields
from coordinator.api.structured_outputs import StructuredFields
from coordinator.api.tool_calls import ToolFields
from coordinator.errors import invalid_request
from engine.core.choices import MAX_CHOICES

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}
ROLES = ("system", "developer", "user", "assistant", "tool")
# chat_template_kwargs a client may set: name -> allowed values (None: any bool)
TEMPLATE_KWARGS: dict[str, tuple[str, ...] | None] = {
    "enable_thinking": None,                          # Qwen3-style templates
    "thinking": None,                                 # DeepSeek-style templates
    "reasoning_effort": ("low", "medium", "high"),    # gpt-oss-style templates
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    """`include_usage` left out is implied by `continuous_usage_stats: true` (vLLM's default is true); with
    `include_usage: false` continuous usage has no usage to repeat, so no chunk carries one (vLLM's answer too)."""

    include_usage: bool | None = None
    include_phases: bool = False  # pdserve's: `phases` on the usage chunk (coordinator.observability.phases)
    continuous_usage_stats: bool = False  # vLLM's and SGLang's: every chunk carries the usage so far

    @property
    def usage(self) -> bool:
        """Whether the stream ends with a usage chunk."""
        return self.include_usage if self.include_usage is not None else self.continuous_usage_stats

    @model_validator(mode="after")
    def _phases_need_usage(self) -> StreamOptions:
        if self.include_phases and not self.usage:
            raise ValueError("stream_options.include_phases: requires include_usage (the usage chunk carries them)")
        return self


class _Common(_Strict, StructuredFields, SamplingFields):  # response_format, structured_outputs, guided_*; penalties
    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, le=2**31 - 1)
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1  # choices per prompt (coordinator.api.choices), 1..MAX_CHOICES
    prompt_logprobs: int | None = None  # vLLM's: top alternatives of every prompt token, 0..20
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    # vLLM's extension: lower first; or high | normal | low (coordinator.admission.tenants)
    priority: int | str | None = None
    user: str | None = Field(default=None, max_length=256)  # logged with the request id, nothing else
    metadata: dict[str, str] | None = Field(default=None, max_length=16)  # logged with the request id
    store: bool | None = None  # only false/null: nothing is stored
    return_token_ids: bool | None = None  # vLLM's: `token_ids` per choice, `prompt_token_ids` (coordinator.api.sse)
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name each token `token_id:<id>`

    @model_validator(mode="after")
    def _supported(self) -> _Common:
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n: must be in [1, {MAX_CHOICES}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError("prompt_logprobs: must be in [0, 20]")
        if self.store:
            raise ValueError("store: this server does not store completions (use false)")
        if any(len(k) > 64 or len(v) > 512 for k, v in (self.metadata or {}).items()):
            raise ValueError("metadata: keys of at most 64 characters, values of at most 512")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(s == "" for s in stops):
            raise ValueError("stop: stop strings must not be empty")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.usage)

    @property
    def include_phases(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_phases)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats and self.stream_options.usage)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _single_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) > MAX_CHOICES:
                raise ValueError(f"prompt: at most {MAX_CHOICES} prompts per request")
        if self.best_of is not None:
            if not (self.n or 1) <= self.best_of <= MAX_CHOICES:
                raise ValueError(f"best_of: must be in [n, {MAX_CHOICES}]")
            if self.stream and self.best_of > 1:
                raise ValueError("best_of: cannot be used with stream (as OpenAI)")
        if len(self.prompts) * (self.best_of or self.n or 1) > MAX_CHOICES:
            raise ValueError(f"n: prompts times n (or best_of) must be at most {MAX_CHOICES}")
        if self.suffix:
            raise ValueError("suffix: not supported")
        return self

    @property
    def single_prompt(self) -> str | list[int]:
        return self.prompts[0]

    @property
    def prompts(self) -> list[str | list[int]]:
        """Every prompt of the request (a string or token ids each; OpenAI's list forms)."""
        p = self.prompt
        return list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content}


class ChatCompletionRequest(_Common, ToolFields):  # tools, tool_choice, parallel_tool_calls
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the prompt ends inside the last message, which the output continues
    echo: bool = False  # vLLM's: the last message's content before the output when its role is the generated one's
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.echo and self.tool_mode != "none":
            raise ValueError("echo: not with tools on this server (tool_choice none lets the tools reach the template)")
        if self.continue_final_message:
            if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
                raise ValueError("continue_final_message: cannot be used with add_generation_prompt true (as vLLM: "
                                 "set add_generation_prompt to false, or leave it out)")
            last = self.messages[-1]
            if not (last.content if isinstance(last.content, str) else "".join(p.text for p in last.content or ())
                    ).strip():
                raise ValueError(f"messages[{len(self.messages) - 1}].content: continue_final_message needs a final "
                                 "message with text to continue")
        for i, m in enumerate(self.messages):
            if m.role not in ROLES:
                raise ValueError(f"messages[{i}].role: unknown role {m.role[:40]!r}; expected one of {list(ROLES)}")
            if m.content is None and not (m.role == "assistant" and (m.model_extra or {}).get("tool_calls")):
                raise ValueError(f"messages[{i}].content: must be a string or a list of text parts (null only on "
                                 "an assistant message with tool_calls)")
        for key, value in (self.chat_template_kwargs or {}).items():
            if key not in TEMPLATE_KWARGS:
                raise ValueError(f"chat_template_kwargs: key {key[:40]!r} is not allowed; allowed keys: "
                                 f"{sorted(TEMPLATE_KWARGS)}")
            allowed = TEMPLATE_KWARGS[key]
            if (allowed is None and not isinstance(value, bool)) or (allowed is not None and value not in allowed):
                raise ValueError(f"chat_template_kwargs: {key} must be {'a boolean' if allowed is None else allowed}, "
                                 f"got {value!r}")
        return self

    @property
    def generation_prompt(self) -> bool:
        """Whether the template opens a new assistant message (not with continue_final_message)."""
        return self.add_generation_prompt and not self.continue_final_message

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def chat_echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's content when its role is the role of the message generated (assistant
    when a generation prompt opens one, else the last message's own role), or ""."""
    if not req.echo:
        return ""
    last = req.messages[-1]
    role = "assistant" if req.generation_prompt else last.role
    if last.role != role:
        return ""
    return last.content if isinstance(last.content, str) else "".join(p.text for p in last.content or ())


def param_of(loc: tuple) -> str | None:
    """OpenAI's `param` for a pydantic error location: messages[0].content, stop, ..."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
        else:
            break
    return out or None


def parse(model: type[_Common], body: Any) -> Any:
    """Validate a decoded JSON body; every problem is a 400 naming the parameter."""
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errs = e.errors()  # an unknown field first, unless a wrong tag (a part's `type`) explains it better
        unknown = [x for x in errs if x.get("type") == "extra_forbidden"]
        err = unknown[0] if unknown and not any(x.get("type") == "literal_error" for x in errs) else errs[0]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        loc = tuple(err.get("loc", ()))
        if err.get("type") == "extra_forbidden":  # name the field itself, past union tags such as list[TextPart]
            loc = tuple(p for p in loc if not (isinstance(p, str) and "[" in p))
        param = param_of(loc)
        named = re.match(r"^([a-z_][a-z_.\[\]0-9]*): (.*)$", msg, re.S)
        if err.get("type") == "value_error" and named:
            param, msg = named.group(1), named.group(2)
        elif err.get("type") == "missing":
            msg = "is required"
        elif err.get("type") == "extra_forbidden":
            msg = ("unknown parameter: not supported by this server (docs/parameters.md lists every parameter it "
                   "accepts)")
        raise invalid_request(f"{param or 'body'}: {msg}" if param else msg, param) from None
