"""What of a failure's text, or of a client's own input, an error message may carry back to the client.

A library's message (a tokenizer, a JSON parser, a grammar or schema compiler) is written for a Python programmer:
it names its exception type ("TypeError: TextInputSequence must be str"), and it quotes the input it choked on,
whole. `describe(e)` maps the failures hostile input provokes to the reason a client can act on (nesting deeper
than the parsers go; text that is not valid Unicode), and `plain(text)` is what every 4xx message goes through
(coordinator.errors.APIError): no Python type name, no run of more than ECHOED_CHARS characters without a space,
no line over MAX_LINE_CHARS and no message over MAX_MESSAGE_CHARS, so a 7,000-character input comes back as a
short excerpt at most. `clip(text)` shortens one string a message names (a model name, a parameter).
"""

from __future__ import annotations

import re

ECHOED_CHARS = 100       # of one client string (a model name, a parameter, a run without spaces) a message repeats
MAX_LINE_CHARS = 200     # of one line of a library's message (its excerpt of the input)
MAX_MESSAGE_CHARS = 500  # of a whole 4xx message
# a Python exception's type name as tracebacks print it ("TypeError: ", "llguidance.GbnfToLarkError: ")
PYTHON_TYPE = re.compile(r"\b(?:[a-z_][a-z0-9_]*\.)*[A-Z][A-Za-z0-9]*(?:Error|Exception|Warning)\b:?[ \t]*")
_LONG_RUN = re.compile(rf"\S{{{ECHOED_CHARS + 1},}}")
NESTED_TOO_DEEPLY = "nested too deeply"
NOT_UNICODE = "holds text that is not valid Unicode (a lone surrogate such as \\ud800)"
_NESTING = ("recursion limit exceeded", "maximum recursion depth", "too deeply nested", "nesting too deep")
_ENCODING = ("textinputsequence must be str", "surrogates not allowed", "invalid unicode", "lone surrogate")


def clip(text: str, limit: int = ECHOED_CHARS) -> str:
    """`text`, or its first `limit` characters and how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def plain(text: str) -> str:
    """`text` without Python type names and with long excerpts of the input cut (see the module docstring)."""
    text = PYTHON_TYPE.sub("", text)
    text = _LONG_RUN.sub(lambda m: m.group()[:ECHOED_CHARS] + "...", text)
    text = "\n".join(line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS] + "..."
                     for line in text.split("\n"))
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 3] + "..."


def describe(e: BaseException | str) -> str:
    """Why a library refused the client's input, in words for the client: a known cause named plainly, otherwise
    the library's own message made `plain`."""
    text = str(e)
    lowered = text.lower()
    if isinstance(e, RecursionError) or any(s in lowered for s in _NESTING):
        return NESTED_TOO_DEEPLY
    if isinstance(e, UnicodeError) or any(s in lowered for s in _ENCODING):
        return NOT_UNICODE
    return plain(text).strip() or "not accepted"
