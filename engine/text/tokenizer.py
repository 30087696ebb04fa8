"""Text <-> token ids and chat formatting for one checkpoint, without transformers.

Owns: loading `tokenizer.json` with the `tokenizers` library, applying `tokenizer_config.json` the way
transformers' fast tokenizer does, and rendering the chat template in a sandboxed jinja2 environment
that mirrors transformers' (trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`, `tojson`,
`strftime_now`, `{% generation %}`, the special tokens as variables).

BOS/EOS: named special tokens become special added tokens, as in transformers. The post-processor of
`tokenizer.json` decides what `encode(add_special_tokens=True)` adds (Llama 3's TemplateProcessing, and Llama 2's
`<s> $A`), and `add_bos_token`/`add_eos_token` are then ignored, as transformers 5 does. Only when tokenizer.json
has no post-processor do those flags build one (`[bos] $A [eos]`, as transformers 4's `update_post_processor`);
transformers 5 would add nothing there, silently dropping the BOS the checkpoint asks for.
Note: a Llama-3-style template already writes `bos_token`; encode its output with `add_special_tokens=False`.

`encode_chat` renders and encodes a conversation so that only the special tokens the template writes become
control tokens: special-token text inside the messages and the other values given to the template (`tools`: a
description or property name holding "<|eot_id|>") is encoded as plain text, unless the caller allows it. Every such
string (and key) has its special-token text swapped for a unique placeholder, the template renders, the special
tokens of that rendering are found by the tokenizer itself, and the text between them (placeholders restored) is
encoded with special-token matching off.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as Backend

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template, or the template refused the messages."""


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers in some templates): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_source(folder: Path, config: dict[str, Any]) -> str | None:
    """`chat_template.jinja` wins over the config's `chat_template` (a string, or a list of named templates)."""
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _ending_with_final(text: str, final: Any) -> str:
    """`text` cut right after the last occurrence of the final message's content (its trailing whitespace kept only
    where the template kept it)."""
    core = final.strip() if isinstance(final, str) else ""
    at = text.rfind(core) if core else -1
    if at < 0:
        raise ChatTemplateError("continue_final_message: the chat template does not render the final message's "
                                "content as given, so the prompt cannot end inside it")
    kept = final.lstrip()
    return text[:at + (len(kept) if text.startswith(kept, at) else len(core))]


class Tokenizer:
    """One checkpoint's tokenizer; immutable after construction, safe to share between requests."""

    def __init__(self, backend: Backend, config: dict[str, Any], chat_template: str | None, source: str) -> None:
        self._backend = backend
        self._source = source
        self.special_tokens_map: dict[str, str] = {}
        for key in NAMED_SPECIAL_TOKENS:
            content = _token_content(config.get(key))
            if content is not None:
                self.special_tokens_map[key] = content
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        extra_contents = [c for c in map(_token_content, extra) if c is not None] if isinstance(extra, list) else []
        self._register_specials([*self.special_tokens_map.values(), *extra_contents])
        self.bos_token_id = self._id_of(self.special_tokens_map.get("bos_token"))
        self.eos_token_id = self._id_of(self.special_tokens_map.get("eos_token"))
        if backend.post_processor is None:
            self._rebuild_post_processor(bool(config.get("add_bos_token")), bool(config.get("add_eos_token")))
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        self._chat_template = _compile_template(chat_template) if chat_template is not None else None

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: file not found (the engine reads tokenizers' tokenizer.json)")
        backend = Backend.from_file(str(path))
        config_path = folder / TOKENIZER_CONFIG_FILE
        config: dict[str, Any] = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
            if not isinstance(config, dict):
                raise ValueError(f"{config_path}: expected a JSON object at top level")
        return cls(backend, config, _chat_template_source(folder, config), str(folder))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _register_specials(self, contents: Sequence[str]) -> None:
        """Named special tokens not already added as special become special added tokens (as transformers)."""
        known = {tok.content for tok in self._backend.get_added_tokens_decoder().values() if tok.special}
        new = [AddedToken(c, special=True, normalized=False) for c in dict.fromkeys(contents) if c not in known]
        if new:
            self._backend.add_special_tokens(new)

    def _rebuild_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        """transformers 4's `update_post_processor`: `[bos] $A [eos]` from the config flags."""
        bos, eos = self.special_tokens_map.get("bos_token"), self.special_tokens_map.get("eos_token")
        add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
        single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
        pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
        specials = ([(bos, self.bos_token_id)] if add_bos else []) + ([(eos, self.eos_token_id)] if add_eos else [])
        self._backend.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                                     special_tokens=specials)

    @property
    def vocab_size(self) -> int:
        """Number of token ids including added tokens (transformers' `len(tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    @cached_property
    def _text_backend(self) -> Backend:
        """A copy of the backend that encodes special-token text as text (the flag is per object, so a shared
        backend is never toggled under a concurrent caller)."""
        backend = Backend.from_str(self._backend.to_str())
        backend.encode_special_tokens = True
        return backend

    @cached_property
    def _special_pattern(self) -> re.Pattern[str] | None:
        specials = sorted({t.content for t in self._backend.get_added_tokens_decoder().values() if t.special},
                          key=len, reverse=True)
        return re.compile("|".join(map(re.escape, specials))) if specials else None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    special_tokens_in_content: bool = False, continue_final_message: bool = False,
                    **template_kwargs: Any) -> list[int]:
        """The conversation's prompt ids: the template's special tokens as control tokens; special-token text
        in the messages and `template_kwargs` (tools) as plain text unless `special_tokens_in_content`;
        `continue_final_message`: the prompt ends with the last message's text (apply_chat_template)."""
        if special_tokens_in_content or self._special_pattern is None:
            text = self.apply_chat_template(messages, add_generation_prompt, continue_final_message,
                                            **template_kwargs)
            return self.encode(text, add_special_tokens=False)
        nonce = f"\ue000{uuid.uuid4().hex}"
        found: list[str] = []

        def hide(value: Any) -> Any:
            if isinstance(value, str):
                return self._special_pattern.sub(lambda m: f"{nonce}:{found.append(m.group()) or len(found) - 1}"
                                                 "\ue001", value)
            if isinstance(value, dict):
                return {hide(k): hide(v) for k, v in value.items()}
            return [hide(v) for v in value] if isinstance(value, list) else value

        hidden = [{k: (v if k == "role" else hide(v)) for k, v in m.items()} for m in messages]
        template_kwargs = {k: hide(v) for k, v in template_kwargs.items()}  # `tools`: names, descriptions, schemas
        text = self.apply_chat_template(hidden, add_generation_prompt, continue_final_message, **template_kwargs)
        if not found:
            return self.encode(text, add_special_tokens=False)
        placeholder = re.compile(re.escape(nonce) + r":(\d+)\ue001")

        def as_text(segment: str) -> list[int]:
            segment = placeholder.sub(lambda m: found[int(m.group(1))], segment)
            return self._text_backend.encode(segment, add_special_tokens=False).ids if segment else []

        rendered = self._backend.encode(text, add_special_tokens=False)
        ids: list[int] = []
        pos = 0
        for token_id, (start, end) in zip(rendered.ids, rendered.offsets, strict=True):
            if token_id in self.special_token_ids:  # a control token the template wrote
                ids += as_text(text[pos:start])
                ids.append(token_id)
                pos = end
        return ids + as_text(text[pos:])

    def to_json(self) -> str:
        """The whole tokenizer (vocabulary, merges, added tokens) as tokenizer.json text, for the grammar library."""
        return self._backend.to_str()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def decode_stream(self, context: Sequence[int],
                      skip_special_tokens: bool = True) -> Callable[[int], str | None] | None:
        """Incremental decoding in tokenizers' DecodeStream (Rust), after `context` ids whose text it does not
        return: step(id) -> the text that id completes, or None while it completes none (engine.text.detokenizer).
        None where the installed tokenizers has no DecodeStream taking `ids` (before 0.22): decode instead."""
        try:
            from tokenizers.decoders import DecodeStream
            stream = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        except (ImportError, TypeError):
            return None
        backend = self._backend
        return lambda token_id: stream.step(backend, token_id)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **template_kwargs: Any) -> str:
        """The rendered prompt text (transformers' `apply_chat_template(..., tokenize=False)`). With
        `continue_final_message` (transformers' and vLLM's), the text ends right after the last message's content
        (whatever the template writes after it, an end-of-turn token, is cut), so the model continues that message;
        its content must appear in the rendering (ChatTemplateError otherwise)."""
        if self._chat_template is None:
            raise ChatTemplateError(f"{self._source}: the tokenizer has no chat template (neither "
                                    f"{CHAT_TEMPLATE_FILE} nor 'chat_template' in {TOKENIZER_CONFIG_FILE})")
        if not messages:
            raise ChatTemplateError("cannot apply a chat template to an empty conversation")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens_map, "tools": None, "documents": None, **template_kwargs}
        try:
            text = self._chat_template.render(messages=chat, add_generation_prompt=add_generation_prompt,
                                              **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"{self._source}: chat template failed: {e}") from e
        return _ending_with_final(text, chat[-1].get("content")) if continue_final_message else text
