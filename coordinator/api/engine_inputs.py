"""A validated OpenAI request (coordinator.api.protocol) translated into what the engine takes.

Owns: the prompt's token ids (chat template, then encoding without added special tokens; token ids checked against
the vocabulary), whether that is cheap enough for the event loop (`tokenize_inline`), the context-length check and
max_tokens default, and `sampling_params()`, which relies on SamplingParams' own range checks and reports them as
400s naming the parameter.
"""

from __future__ import annotations

import re
from typing import Any

from coordinator.api.protocol import ChatCompletionRequest, _Common
from coordinator.api.sampling_fields import processing_kwargs
from coordinator.api.structured_outputs import structured_spec
from coordinator.api.tool_calls import forced_spec
from coordinator.client_text import describe
from coordinator.errors import invalid_request
from engine.core.sampling_params import SamplingParams
from engine.text.tokenizer import ChatTemplateError, Tokenizer


def sampling_params(req: _Common, max_tokens: int, logprobs: int | None, tokenizer: Tokenizer | None = None,
                    vocab_size: int | None = None) -> SamplingParams:
    """SamplingParams for the request; its own validation errors become 400s naming the parameter. The tokenizer
    encodes bad_words; logit_bias ids are checked against vocab_size (coordinator.api.sampling_fields)."""
    kwargs: dict[str, Any] = dict(max_tokens=max_tokens, logprobs=logprobs, ignore_eos=req.ignore_eos,
                                  stop_token_ids=tuple(req.stop_token_ids or ()), seed=req.seed)
    kwargs.update(processing_kwargs(req, tokenizer, vocab_size))
    for name in ("temperature", "top_p", "top_k", "min_p"):
        if getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
    kwargs["structured"] = structured_spec(req, forced_spec(req) if isinstance(req, ChatCompletionRequest) else None)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        named = re.match(r"^SamplingParams\.(\w+) (.*)$", str(e))
        param = named.group(1) if named else None
        if isinstance(req, ChatCompletionRequest) and param == "logprobs":
            param = "top_logprobs"
        param = {"bad_words_token_ids": "bad_words"}.get(param, param)
        raise invalid_request(f"{param}: {named.group(2)}" if named else str(e), param) from None



INLINE_TOKENIZE_CHARS = 1024  # a prompt this short tokenizes faster than a hop to a thread and back (~0.2-0.6 ms)


def tokenize_inline(req: _Common) -> bool:
    """Whether prompt_token_ids(req) is cheap enough to run on the event loop: token ids, or text of at most
    INLINE_TOKENIZE_CHARS (chat: the messages' text, and no tools). Longer prompts go to a thread, so one long prompt
    does not stall every stream; a short one there would cost the loop more (the thread's wake-up and the GIL's
    handoffs) than encoding it."""
    if isinstance(req, ChatCompletionRequest):
        if req.tools:  # rendered into the template: their schemas may be long
            return False
        chars = 0
        for m in req.messages:
            content = m.content
            chars += len(content) if isinstance(content, str) else sum(len(p.text) for p in content or ())
        return chars <= INLINE_TOKENIZE_CHARS
    return all(not isinstance(p, str) or len(p) <= INLINE_TOKENIZE_CHARS for p in req.prompts)


def prompt_token_ids(req: _Common, tokenizer: Tokenizer, vocab_size: int,
                     special_tokens_in_content: bool = False) -> list[int]:
    """The prompt as token ids: chat template then encode (only the template's special tokens are control tokens,
    unless `special_tokens_in_content`), or the completion prompt encoded (with BOS) or taken as given; every id,
    and every stop token id, in the vocabulary."""
    chat = isinstance(req, ChatCompletionRequest)
    where = "messages" if chat else "prompt"
    try:
        if chat:
            ids = tokenizer.encode_chat([m.for_template() for m in req.messages], req.generation_prompt,
                                        special_tokens_in_content, continue_final_message=req.continue_final_message,
                                        **(req.chat_template_kwargs or {}),
                                        **({"tools": req.template_tools()} if req.tools else {}))
        else:
            prompt = req.single_prompt
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    except ChatTemplateError as e:
        raise invalid_request(str(e), where) from None
    except Exception as e:  # noqa: BLE001 - a template choking on the messages, a lone surrogate (valid JSON, not
        # UTF-8): the client's input, not a server fault
        raise invalid_request(f"{where}: cannot be tokenized: {describe(e)}", where) from None
    if not ids:
        raise invalid_request("prompt: must not be empty", "prompt")
    for name, values in (("prompt", ids), ("stop_token_ids", req.stop_token_ids or [])):
        bad = [t for t in values if not 0 <= t < vocab_size]
        if bad:
            raise invalid_request(f"{name}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", name)
    return ids


def max_tokens(req: _Common, prompt_len: int, max_model_len: int) -> int:
    """The request's max_tokens: its own (checked against the context) or, for chat, all the context left."""
    where = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    if prompt_len >= max_model_len:
        raise invalid_request(f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                              f"{prompt_len} tokens and leaves no room to generate", where, "context_length_exceeded")
    wanted = req.requested_max_tokens if isinstance(req, ChatCompletionRequest) else req.max_tokens
    if wanted is None:
        return max_model_len - prompt_len
    if wanted >= 1 and prompt_len + wanted > max_model_len:
        raise invalid_request(f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                              f"{prompt_len} tokens and max_tokens is {wanted}", "max_tokens",
                              "context_length_exceeded")
    return wanted
